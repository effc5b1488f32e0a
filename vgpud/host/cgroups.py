"""cgroup v2 paths from cgroup ids (what upcall headers carry)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

__all__ = ["cgroup_path_by_id"]


def cgroup_path_by_id(root: Path = Path("/sys/fs/cgroup")) -> Callable[[int], str | None]:
    """Finds a cgroup v2 path from its id (the inode number of its directory).

    For contexts opened before the daemon started (their upcalls carry the
    cgroup id, not the path); walks the hierarchy once per unknown id.
    """

    @lru_cache(maxsize=4096)
    def lookup(cgroup_id: int) -> str | None:
        try:
            if root.stat().st_ino == cgroup_id:
                return "/"
            for dirpath, _dirs, _files in os.walk(root):
                if os.stat(dirpath).st_ino == cgroup_id:
                    return "/" + os.path.relpath(dirpath, root)
        except OSError:
            pass
        return None

    return lookup
