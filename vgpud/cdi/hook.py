"""What the createRuntime hook reads: the container's OCI state.

The runtime (crun, runc) runs the hook as itself, in the host's namespaces,
with the state on stdin (OCI runtime spec, "State"): its ``pid`` is the
container's process, as the host sees it, created but not yet running the
container's program. Pure: bytes in, a pid out, or ValueError saying why.
"""

from __future__ import annotations

import json

__all__ = ["MAX_STATE_BYTES", "container_pid"]

# A state is an id, a bundle path, a status, a pid and annotations: a few KiB.
MAX_STATE_BYTES = 1 << 20
_PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT on 64-bit


def container_pid(state: bytes) -> int:
    """The pid of the container's process from an OCI state document."""
    if len(state) > MAX_STATE_BYTES:
        raise ValueError(f"the OCI state on stdin is over {MAX_STATE_BYTES} bytes")
    try:
        doc = json.loads(state)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the OCI state on stdin is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError("the OCI state on stdin is not a JSON object")
    pid = doc.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= _PID_MAX:
        raise ValueError(f"the OCI state has no container process (pid {pid!r}): "
                         "run this as a createRuntime hook")
    return pid
