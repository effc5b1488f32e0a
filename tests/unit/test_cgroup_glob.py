"""cgroup path globs: `*` stays within a component, `**` spans them (item 15 of
issue 10: a pod that makes a sub-cgroup named like another tenant's must not
match that tenant's rule)."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.core.cgroup_glob import compile_glob, glob_matches
from vgpud.core.tenants import MatchRule

COMPONENT = st.text(alphabet="abcxyzA0-_.*?[]!&~|^", min_size=1, max_size=6)
PLAIN = st.text(alphabet="abcxyzA0-_.&~|^", min_size=1, max_size=6)


def test_star_stays_in_one_component() -> None:
    assert glob_matches("/kubepods.slice/*team-a*", "/kubepods.slice/pod-team-a-1")
    # the attack: a pod's own sub-cgroup named after another team
    assert not glob_matches("/kubepods.slice/*team-a*", "/kubepods.slice/pod-b/team-a")
    assert not glob_matches("/a/?", "/a//")


def test_double_star_spans_components() -> None:
    assert glob_matches("/kubepods.slice/**team-a*", "/kubepods.slice/pod-b/team-a")
    assert glob_matches("/a/**/c", "/a/b/x/c")


def test_trailing_double_star_is_the_cgroup_and_its_subtree() -> None:
    assert glob_matches("/ci.slice/**", "/ci.slice")
    assert glob_matches("/ci.slice/**", "/ci.slice/job/ctr")
    assert not glob_matches("/ci.slice/**", "/ci.slicex")


def test_classes() -> None:
    assert glob_matches("/a/[bc]", "/a/c")
    assert glob_matches("/a/[!x]", "/a/y")
    assert not glob_matches("/a/[!x]", "/a//")
    assert glob_matches("/a/[]]", "/a/]")
    assert glob_matches("/a/[", "/a/[")  # unclosed: a literal
    assert glob_matches("/a/[^]", "/a/^")
    # a negated class starting with "-": "-" and "a" are out, the rest in (it
    # once read "[^/-a]", the range "/" to "a")
    assert not glob_matches("/a/[!-a]", "/a/-") and not glob_matches("/a/[!-a]", "/a/a")
    assert glob_matches("/a/[!-a]", "/a/_") and glob_matches("/a/[!-a]", "/a/0")
    assert glob_matches("/a/[&&x]", "/a/&") and glob_matches("/a/[a-]", "/a/-")


def test_a_class_naming_slash_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot match '/'"):
        compile_glob("/a[/]b")
    with pytest.raises(ValueError, match="cannot match '/'"):
        MatchRule(cgroup="/a[/]b")


def test_regex_metacharacters_are_literal() -> None:
    assert glob_matches("/a.b+(c)", "/a.b+(c)")
    assert not glob_matches("/a.b", "/axb")


@given(st.lists(PLAIN, min_size=1, max_size=4), st.lists(COMPONENT, min_size=1, max_size=4))
def test_star_never_crosses_a_slash(path: list[str], pattern: list[str]) -> None:
    """Without `**`, a glob of n components only matches paths of n components."""
    glob = "/" + "/".join(pattern)
    if "**" in glob:
        return
    try:
        rx = compile_glob(glob)
    except ValueError:
        return
    p = "/" + "/".join(path)
    if rx.fullmatch(p):
        assert len(path) == len(pattern)


@pytest.mark.filterwarnings("error::FutureWarning")  # re's "possible set operation"
@given(st.lists(PLAIN, min_size=1, max_size=4), st.lists(COMPONENT, min_size=1, max_size=4))
def test_within_one_component_it_agrees_with_fnmatch(path: list[str], pattern: list[str]) -> None:
    """Component by component, the glob means what fnmatch means."""
    if len(path) != len(pattern) or any("**" in c or "/" in c for c in pattern):
        return
    glob = "/" + "/".join(pattern)
    try:
        rx = compile_glob(glob)
    except ValueError:
        return
    expect = all(fnmatch.fnmatchcase(p, c) for p, c in zip(path, pattern, strict=True))
    assert (rx.fullmatch("/" + "/".join(path)) is not None) == expect


def test_bad_ranges_are_value_errors() -> None:
    """A reversed range is a clear error, not re.error; a range that spans
    '/' would let a class cross components."""
    with pytest.raises(ValueError, match="bad \\[class\\]"):
        compile_glob("/a[?-.]")
    with pytest.raises(ValueError, match="cannot match '/'"):
        compile_glob("/a[.-0]b")
    with pytest.raises(ValueError, match="bad \\[class\\]"):
        MatchRule(cgroup="/k[z-a]")
    assert glob_matches("/a[!.-0]", "/ax") and not glob_matches("/a[!.-0]", "/a/")
