"""The spec file on disk: written atomically, removed only if it is ours.

A runtime reads the spec directory whenever a container is created: it must
see the old spec or the new one, never a part. So the new one is written to a
temporary file in the same directory, flushed, made 0644 and renamed over the
old one. vgpud writes and removes one file there, SPEC_FILE, and nothing else.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from vgpud.cdi.spec import SPEC_FILE, Hook, Spec, render

__all__ = ["SpecFile", "this_hook"]

SPEC_MODE = 0o644


class SpecFile:
    def __init__(self, spec_dir: Path) -> None:
        self.path = Path(spec_dir) / SPEC_FILE

    def write(self, spec: Spec) -> None:
        """Replace the spec file with ``spec`` at once (OSError: nothing changed)."""
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{SPEC_FILE}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(render(spec))
                f.flush()
                os.fchmod(f.fileno(), SPEC_MODE)
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def update(self, spec: Spec) -> None:
        """Write ``spec``, or remove the file when it has no device (a spec
        without devices offers nothing and some consumers reject it)."""
        if spec.content["devices"]:
            self.write(spec)
        else:
            self.remove()

    def remove(self) -> None:
        """Remove our spec file (none is no error); other files stay."""
        with suppress(FileNotFoundError):
            self.path.unlink()


def this_hook() -> Hook:
    """The hook for specs made by this process: the vgpuctl installed beside
    its Python (as pip and the Debian package install it), else the one on
    PATH; with this process's DBUS_SYSTEM_BUS_ADDRESS, if set, so that the
    hook reaches the daemon on the bus the daemon serves. OSError if there is
    no vgpuctl."""
    beside = Path(sys.executable).parent / "vgpuctl"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("vgpuctl")
    if found is None:
        raise OSError("no vgpuctl beside the Python running vgpud nor on PATH: "
                      "the CDI hook needs it")
    bus = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")
    return Hook(os.path.abspath(found), (f"DBUS_SYSTEM_BUS_ADDRESS={bus}",) if bus else ())
