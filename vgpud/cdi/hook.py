"""What the CDI hooks read: the container's OCI state and its cgroup.

The runtime (crun, runc) runs a hook as itself, in the host's namespaces,
with the state on stdin (OCI runtime spec, "State"). At createRuntime its
``pid`` is the container's process, as the host sees it, created but not yet
running the container's program; the createRuntime hook binds that process's
cgroup (``/proc/PID/cgroup``, whose "0::" line is the cgroup v2 path from the
host's cgroup2 root), so that every process the container forks belongs to
the tenant. At poststop the process is gone and only the ``id`` is left: the
createRuntime hook records the cgroup it bound under that id (a record file
of vgpuctl's), and the poststop hook unbinds it.

Pure: bytes and text in, values out, or ValueError saying why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_STATE_BYTES", "ContainerState", "cgroup_line", "cgroup_v2_path", "container_pid",
           "container_state", "record_name", "within"]

# A state is an id, a bundle path, a status, a pid and annotations: a few KiB.
MAX_STATE_BYTES = 1 << 20
_PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT on 64-bit
# Container ids as a record's file name: podman's, runc's and containerd's
# (64 hex digits, or names of letters, digits, '_', '.', '-').
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,255}")


@dataclass(frozen=True, slots=True)
class ContainerState:
    """The parts of an OCI state the hooks use; ``pid`` None when absent or 0
    (a stopped container's state)."""

    id: str
    pid: int | None


def _document(state: bytes) -> dict[str, Any]:
    if len(state) > MAX_STATE_BYTES:
        raise ValueError(f"the OCI state on stdin is over {MAX_STATE_BYTES} bytes")
    try:
        doc = json.loads(state)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the OCI state on stdin is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError("the OCI state on stdin is not a JSON object")
    return doc


def container_state(state: bytes) -> ContainerState:
    """The id and, if it has one, the pid of an OCI state document."""
    doc = _document(state)
    cid, pid = doc.get("id"), doc.get("pid")
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"the OCI state has no container id (id {cid!r})")
    if pid in (None, 0):
        return ContainerState(cid, None)
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= _PID_MAX:
        raise ValueError(f"the OCI state has an invalid pid {pid!r}")
    return ContainerState(cid, pid)


def container_pid(state: bytes) -> int:
    """The pid of the container's process from an OCI state document."""
    pid = container_state(state).pid
    if pid is None:
        raise ValueError("the OCI state has no container process (pid 0): "
                         "run this as a createRuntime hook")
    return pid


def cgroup_line(text: str) -> str:
    """The path of a /proc/PID/cgroup text's "0::" line, as it is."""
    lines = [line[3:] for line in text.split("\n") if line.startswith("0::")]
    if len(lines) != 1:
        raise ValueError("no single cgroup v2 (0::) line in /proc/PID/cgroup")
    return lines[0]


def cgroup_v2_path(text: str) -> str:
    """The cgroup v2 path of a /proc/PID/cgroup text: its "0::" line.

    Refused: no such line (a host without cgroup v2), a path outside the
    reader's cgroup namespace ("/.." components: the hook must run in the
    host's), a cgroup being removed (" (deleted)"), and the root cgroup, which
    holds every process that has no cgroup of its own.
    """
    path = cgroup_line(text)
    if path.endswith(" (deleted)"):
        raise ValueError(f"the container's cgroup {path!r} is being removed")
    if path == "/":
        raise ValueError("the container is in the root cgroup: it has no cgroup of its own "
                         "to bind (does the runtime manage cgroups?)")
    if not path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")[1:]):
        raise ValueError(f"the container's cgroup {path!r} is not a path in this "
                         "cgroup namespace: run the hook in the host's")
    return path


def within(path: str, ancestor: str) -> bool:
    """`path` is `ancestor` or below it (both normalized cgroup paths)."""
    return path == ancestor or path.startswith(ancestor.rstrip("/") + "/")


def record_name(container_id: str) -> str:
    """The record file name of a container id (the id itself, when it is a
    safe file name: no '/', no leading '.')."""
    if not _ID_RE.fullmatch(container_id):
        raise ValueError(f"container id {container_id!r} is not a plain name")
    return container_id
