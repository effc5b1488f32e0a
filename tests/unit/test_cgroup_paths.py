"""CgroupPaths: lookups answer from a walk made off the loop, bounded."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from vgpud.host.cgroups import CgroupPaths


def tree(root: Path) -> dict[str, int]:
    for sub in ("a", "a/b", "c", "c/d/e"):
        (root / sub).mkdir(parents=True)
    return {p: os.stat(root / p.lstrip("/")).st_ino if p != "/" else os.stat(root).st_ino
            for p in ("/", "/a", "/a/b", "/c/d/e")}


def test_lookup_never_walks_and_prefetch_finds(tmp_path: Path) -> None:
    ids = tree(tmp_path)
    paths = CgroupPaths(tmp_path)
    assert paths(ids["/a/b"]) is None  # nothing walked on a lookup
    asyncio.run(paths.prefetch([ids["/a/b"], ids["/c/d/e"], ids["/"], 999_999_999]))
    assert paths(ids["/a/b"]) == "/a/b"
    assert paths(ids["/c/d/e"]) == "/c/d/e"
    assert paths(ids["/"]) == "/"
    assert paths(999_999_999) is None


def test_walk_is_bounded(tmp_path: Path) -> None:
    ids = tree(tmp_path)
    paths = CgroupPaths(tmp_path, max_dirs=1)  # the root only
    assert paths.find([ids["/a/b"], ids["/"]]) == {ids["/"]: "/"}


def test_missing_root(tmp_path: Path) -> None:
    assert CgroupPaths(tmp_path / "none").find([1]) == {}
