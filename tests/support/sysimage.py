"""The booted system of scripts/sysimage-run, as its tests see it from inside:
systemd as PID 1, the installed vgpud (/opt/vgpud), systemctl, journalctl and
busctl, and commands run as other users."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.guest import in_guest

INSTALLED = Path("/opt/vgpud/bin")
VGPUCTL = INSTALLED / "vgpuctl"
UNIT = "vgpud.service"
# systemd's drop-ins of the tests (a runtime directory: gone with the boot).
DROPIN_DIR = Path("/run/systemd/system") / f"{UNIT}.d"


def booted() -> bool:
    """True in the image booted by scripts/sysimage-run, with the modules built."""
    try:
        init = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return False
    return init == "systemd" and (INSTALLED / "vgpud").exists() and in_guest()


def sh(*cmd: str, user: str | None = None, check: bool = True,
       timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, as ``user`` through runuser(1) (a login's groups) if given."""
    argv = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
    res = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    if check:
        assert res.returncode == 0, f"{argv}: {res.returncode}\n{res.stdout}{res.stderr}"
    return res


def show(*props: str, unit: str = UNIT) -> dict[str, str]:
    """``systemctl show``'s values of ``props``."""
    out = sh("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main_pid() -> int:
    return int(show("MainPID")["MainPID"])


def wait_until(ok: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    """Poll ``ok`` until true; a loaded TCG guest is slow, hence the default."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.2)


def wait_restarted(old_pid: int, timeout: float = 180.0) -> int:
    """Wait until the unit is active again under a main pid other than
    ``old_pid``; return the new one."""
    def up() -> bool:
        state = show("ActiveState", "SubState", "MainPID")
        return (state["ActiveState"], state["SubState"]) == ("active", "running") and \
            int(state["MainPID"]) not in (0, old_pid)
    wait_until(up, f"{UNIT} restarted", timeout)
    return main_pid()


def journal(unit: str = UNIT) -> list[str]:
    """The unit's journal lines of this boot (systemd's own about it
    included); none for a unit pattern that matches no unit that logged."""
    return sh("journalctl", "--boot", f"--unit={unit}", "--output=cat",
              "--no-pager", check="*" not in unit).stdout.splitlines()


def set_dropin(name: str, text: str) -> None:
    DROPIN_DIR.mkdir(parents=True, exist_ok=True)
    (DROPIN_DIR / f"{name}.conf").write_text(text)
    sh("systemctl", "daemon-reload")


def add_user(name: str, uid: int, *groups: str) -> None:
    """A user with a group of its own, also in ``groups``. Written into
    /etc/passwd and /etc/group directly: useradd's lock files need hard
    links, which the image's 9p root does not have."""
    with open("/etc/passwd", "a") as f:
        f.write(f"{name}:x:{uid}:{uid}::/:/usr/sbin/nologin\n")
    group = Path("/etc/group")
    lines = group.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split(":")[0] in groups:
            lines[i] = line + ("," if not line.endswith(":") else "") + name
    group.write_text("\n".join([*lines, f"{name}:x:{uid}:"]) + "\n")


def as_user(uid: int) -> dict[str, object]:
    """Popen keywords that run the child as ``uid`` (its own group, no others)."""
    return {"user": uid, "group": uid, "extra_groups": [], "env": dict(os.environ, HOME="/")}
