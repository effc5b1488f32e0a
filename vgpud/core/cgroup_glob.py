"""Globs on cgroup v2 paths, path-aware as shells and systemd are.

`*` and `?` never match "/", so `/kubepods.slice/*team-a*` matches the pod
cgroup `team-a` created under kubepods.slice, not `team-a` nested in any pod's
own sub-cgroups (which a pod can create). `**` matches any run of characters,
"/" included, and a trailing `/**` matches the cgroup itself and its whole
subtree. `[...]` is a character class (`[!...]` negated) that never matches "/".
"""

from __future__ import annotations

import re
from functools import lru_cache


def _class(pattern: str, i: int) -> tuple[str, int] | None:
    """The regex of the class starting at pattern[i] == "[" and the index after
    it, or None if the bracket is not closed (then it is a literal "[")."""
    j = i + 1
    negate = j < len(pattern) and pattern[j] == "!"
    if negate:
        j += 1
    start = j
    if j < len(pattern) and pattern[j] == "]":
        j += 1  # a leading "]" is a member
    while j < len(pattern) and pattern[j] != "]":
        j += 1
    if j >= len(pattern):
        return None
    body = _members(pattern, pattern[start:j])
    # A negated class excludes "/" by a lookahead: "/" inside it could start a
    # range with the first member ("[^/-a]").
    cls = re.compile(f"(?!/)[^{body}]" if negate else f"[{body}]")
    if cls.fullmatch("/"):  # "/" itself, or in a range: "[.-0]"
        raise ValueError(f"cgroup glob {pattern!r}: a [class] cannot match '/'")
    return cls.pattern, j + 1


def _members(pattern: str, members: str) -> str:
    """A class's members as a regex class body, as fnmatch reads them: "a-z" a
    range, every other character itself (escaped, so that no "^", "[", "&&",
    "--" or "~~" of the glob means anything to re)."""
    out: list[str] = []
    i = 0
    while i < len(members):
        if i + 2 < len(members) and members[i + 1] == "-":
            low, high = members[i], members[i + 2]
            if low > high:
                raise ValueError(f"cgroup glob {pattern!r}: bad [class]: reversed range "
                                 f"{low}-{high}")
            out.append(f"{re.escape(low)}-{re.escape(high)}")
            i += 3
        else:
            out.append(re.escape(members[i]))
            i += 1
    return "".join(out)


@lru_cache(maxsize=1024)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """The regex for a cgroup path glob; ValueError for a glob that cannot be one."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.endswith("/**") and i == len(pattern) - 3:
            out.append("(?:/.*)?")  # a trailing /** is the cgroup and its subtree
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (cls := _class(pattern, i)) is not None:
            out.append(cls[0])
            i = cls[1]
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def glob_matches(pattern: str, path: str) -> bool:
    """Whether the whole cgroup `path` matches `pattern`."""
    return compile_glob(pattern).fullmatch(path) is not None
