"""dmem.peak across daemon restarts: the tenants' peaks on file.

Kept next to the charge journal (a tmpfs, /run/vgpud), so that a restart
keeps the peaks as it keeps the charges, and a reboot forgets both, like a
cgroup's. The file is JSON, ``{"tenant": [bytes per GPU, ...]}``, written
whole and renamed into place. One that cannot be read or does not parse is
logged and ignored: the peaks start again from the current use.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PEAKS_FILE", "load_peaks", "save_peaks"]

log = logging.getLogger(__name__)

PEAKS_FILE = "fs-peaks.json"
MAX_SIZE = 16 << 20  # far above 4096 tenants x 8 GPUs


def load_peaks(path: Path) -> dict[str, tuple[int, ...]]:
    """The peaks saved at ``path``; {} when there are none or they are unusable."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SIZE + 1)
        if len(data) > MAX_SIZE:
            raise ValueError(f"larger than {MAX_SIZE} bytes")
        raw = json.loads(data)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("file view: ignoring the saved peaks in %s: %s", path, exc)
        return {}
    if not isinstance(raw, dict) or not all(
            isinstance(name, str) and isinstance(values, list)
            and all(type(v) is int and v >= 0 for v in values)
            for name, values in raw.items()):
        log.warning("file view: ignoring the saved peaks in %s: not {tenant: [bytes, ...]}",
                    path)
        return {}
    return {name: tuple(values) for name, values in raw.items()}


def save_peaks(path: Path, peaks: Mapping[str, tuple[int, ...]]) -> None:
    """Write ``peaks`` to ``path`` (mode 0600), replacing it whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({name: list(values) for name, values in peaks.items()}, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
