"""Processes as /proc shows them: the start time that makes a pid binding
name one process, and the boot it belongs to."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")
BOOT_ID = PROC / "sys/kernel/random/boot_id"


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """The start time of process `pid` (clock ticks since boot, field 22 of
    /proc/PID/stat), or None if there is no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: count from its last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id; empty if unreadable (bindings then last one daemon run)."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        log.warning("cannot read %s (%s): pid bindings will not survive a restart",
                    path, exc)
        return ""
