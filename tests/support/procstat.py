"""A process's scheduler state read from /proc, for tests that wait on exits."""

from pathlib import Path


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (R, S, D, Z, ...), or "gone" once it is reaped.

    A process reaped between open() and read() makes the read fail with ESRCH
    (ProcessLookupError), not ENOENT: both mean gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]
