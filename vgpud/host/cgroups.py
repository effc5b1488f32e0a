"""cgroup v2 paths from cgroup ids (what upcall headers carry).

An OPEN upcall carries its opener's cgroup path (VGPU_A_CGROUP, from the
module), so a context opened while the daemon runs never needs a lookup.
Only contexts opened before the daemon started are known by their cgroup id
alone (the IOCTL upcall's header, LIST_CONTEXTS); their paths are found
once, at registration, by a walk of the hierarchy in a worker thread
(``CgroupPaths.prefetch``), so the event loop never walks it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MAX_DIRS", "CgroupPaths"]

# Most directories one walk visits: a bound on a hierarchy a tenant with a
# delegated subtree could grow (cgroup.max.descendants); ids not found by
# then resolve without a path (uid, gid and pid matches only).
MAX_DIRS = 100_000


class CgroupPaths:
    """cgroup v2 paths by id: ``paths(cgroup_id)`` answers from what
    ``prefetch`` found and never touches the filesystem (None when unknown)."""

    def __init__(self, root: Path = Path("/sys/fs/cgroup"), max_dirs: int = MAX_DIRS) -> None:
        self.root = root
        self.max_dirs = max_dirs
        self._paths: dict[int, str] = {}

    def __call__(self, cgroup_id: int) -> str | None:
        return self._paths.get(cgroup_id)

    def find(self, ids: Iterable[int]) -> dict[int, str]:
        """One walk (blocking) for these ids; stops when all are found or
        after ``max_dirs`` directories."""
        wanted = set(ids)
        found: dict[int, str] = {}
        try:
            for visited, (dirpath, _dirs, _files) in enumerate(os.walk(self.root)):
                if not wanted or visited >= self.max_dirs:
                    break
                try:
                    ino = os.stat(dirpath).st_ino
                except OSError:
                    continue
                if ino in wanted:
                    wanted.discard(ino)
                    rel = os.path.relpath(dirpath, self.root)
                    found[ino] = "/" if rel == "." else "/" + rel
        except OSError:
            pass
        return found

    async def prefetch(self, ids: Iterable[int]) -> None:
        """Finds the paths of these ids (those not known yet) off the loop."""
        wanted = set(ids) - self._paths.keys()
        if not wanted:
            return
        found = await asyncio.get_running_loop().run_in_executor(None, self.find, wanted)
        self._paths.update(found)
