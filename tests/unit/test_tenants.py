"""Tenant model, memory limit parsing, opener resolution."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from vgpud.core.tenants import (
    U64_MAX,
    Binding,
    CgroupBinding,
    MatchRule,
    MemoryLimit,
    Opener,
    Priority,
    Tenant,
    UvmPolicy,
    resolve,
    start_ticks,
    validate_name,
)

GiB = 2**30


# --- names ---


@pytest.mark.parametrize("name", ["a", "0", "alice", "team-a.gpu_1", "a" * 32, "9lives"])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name
    assert Tenant(name=name).name == name


@pytest.mark.parametrize(
    "name", ["", "a" * 33, "Alice", "-a", ".a", "_a", "a b", "a/b", "é", "a\n", "a:b"]
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant name"):
        validate_name(name)
    with pytest.raises(ValidationError):
        Tenant(name=name)


# --- sizes ---


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * 2**20),
        ("1073741824", GiB),
        (1073741824, GiB),
        ("4KiB", 4096),
        ("1B", 1),
        ("1.5GiB", 3 * GiB // 2),
        ("2 GiB", 2 * GiB),
        ("8gib", 8 * GiB),
        ("1GB", 10**9),
        ("3MB", 3 * 10**6),
        ("2TiB", 2 * 2**40),
        ("15EiB", 15 * 2**60),
        (str(U64_MAX), U64_MAX),
    ],
)
def test_parse_bytes(text: str | int, size: int) -> None:
    limit = MemoryLimit.parse(text)
    assert limit.bytes == size
    assert limit.percent is None


@pytest.mark.parametrize(
    ("text", "percent"),
    [("50%", Fraction(50)), ("100%", Fraction(100)), ("12.5%", Fraction(25, 2)), ("1 %", 1)],
)
def test_parse_percent(text: str, percent: Fraction) -> None:
    limit = MemoryLimit.parse(text)
    assert limit.percent == percent
    assert limit.bytes is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("-1", "negative"),
        ("-8GiB", "negative"),
        (-5, "out of range"),
        (0, "out of range"),
        ("0", "out of range"),
        ("0GiB", "out of range"),
        ("0%", "out of range"),
        ("100.5%", "out of range"),
        ("150%", "out of range"),
        ("-5%", "negative"),
        ("8XB", "unknown unit"),
        ("8 gigs", "unknown unit"),
        ("GiB", "invalid memory size"),
        ("", "invalid memory size"),
        ("8GiB8", "invalid memory size"),
        ("1e9", "invalid memory size"),
        ("0x10", "invalid memory size"),
        ("8 G iB", "invalid memory size"),
        ("0.5B", "whole number"),
        ("16EiB", "out of range"),
        (str(2**64), "out of range"),
        (2**64, "out of range"),
        (True, "must be"),
        (1.5, "must be"),
        (None, "must be"),
    ],
)
def test_parse_rejects(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        MemoryLimit.parse(value)


def test_limit_needs_exactly_one_form() -> None:
    with pytest.raises(ValueError):
        MemoryLimit()
    with pytest.raises(ValueError):
        MemoryLimit(bytes=1, percent=Fraction(1))


@pytest.mark.parametrize(
    "text", ["8GiB", "512MiB", "4KiB", "1000", "50%", "12.5%", "0.001%", "100%"]
)
def test_str_round_trip(text: str) -> None:
    limit = MemoryLimit.parse(text)
    assert MemoryLimit.parse(str(limit)) == limit


@given(st.integers(1, U64_MAX))
def test_str_round_trip_any_size(size: int) -> None:
    limit = MemoryLimit(bytes=size)
    assert MemoryLimit.parse(str(limit)) == limit


def test_effective() -> None:
    total = 80 * GiB
    assert MemoryLimit.parse("50%").effective(total) == 40 * GiB
    assert MemoryLimit.parse("100%").effective(total) == total
    assert MemoryLimit.parse("8GiB").effective(total) == 8 * GiB
    assert MemoryLimit.parse("100GiB").effective(total) == total  # never more than the device
    assert MemoryLimit.parse("12.5%").effective(1001) == 125  # floor


@given(st.integers(0, 2**48), st.integers(1, 1000))
def test_effective_percent_bounded(total: int, tenths: int) -> None:
    limit = MemoryLimit(percent=Fraction(tenths, 10))
    assert 0 <= limit.effective(total) <= total


# --- the model ---


def test_defaults() -> None:
    t = Tenant(name="a")
    assert t.gpus == "all"
    assert t.memory is None
    assert t.uvm is UvmPolicy.COUNT
    assert t.weight == 100
    assert t.cap is None
    assert t.priority is Priority.BEST_EFFORT
    assert t.limit_for(3, 16 * GiB) == 16 * GiB


def test_from_toml_like_values() -> None:
    t = Tenant.model_validate(
        {
            "name": "alice",
            "memory": "8GiB",
            "gpus": [0, 2],
            "uvm": "deny",
            "weight": 300,
            "cap": 50,
            "priority": "priority",
            "pids": [10, 11],
            "match": [{"cgroup": "/kube/*"}, {"uid": 1000}],
        }
    )
    assert t.memory == MemoryLimit(bytes=8 * GiB)
    assert t.gpus == (0, 2)
    assert t.uvm is UvmPolicy.DENY
    assert t.priority is Priority.PRIORITY
    assert t.limit_for(0, 80 * GiB) == 8 * GiB
    assert t.limit_for(1, 80 * GiB) is None
    assert not t.allows_gpu(1)
    assert Tenant.model_validate_json(t.model_dump_json()) == t


@pytest.mark.parametrize(
    "fields",
    [
        {"weight": 0},
        {"weight": 1001},
        {"weight": "100"},
        {"weight": True},
        {"cap": 0},
        {"cap": 101},
        {"uvm": "maybe"},
        {"priority": "high"},
        {"gpus": "some"},
        {"gpus": [0, 0]},
        {"gpus": [-1]},
        {"gpus": [248]},
        {"gpus": [True]},
        {"pids": [0]},
        {"pids": [5, 5]},
        {"match": [{}]},
        {"match": [{"uid": -1}]},
        {"match": [{"pid": 3}]},
        {"color": "red"},
    ],
)
def test_model_rejects(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Tenant.model_validate({"name": "a", **fields})


def test_frozen_and_replace_validates() -> None:
    t = Tenant(name="a")
    with pytest.raises(ValidationError):
        t.weight = 5  # type: ignore[misc]
    assert t.replace(weight=5).weight == 5
    with pytest.raises(ValidationError):
        t.replace(weight=0)


# --- resolution ---


def opener(tgid: int = 100, uid: int = 1000, cgroup: str = "/user.slice/app",
           start: int | None = 5) -> Opener:
    return Opener(pid=tgid + 1, tgid=tgid, uid=uid, gid=uid, cgroup_id=7, cgroup_path=cgroup,
                  start=start)


TENANTS = (
    Tenant(name="pods", match=(MatchRule(cgroup="/kubepods/*/pod-a*/**"),)),
    Tenant(name="bob", match=(MatchRule(uid=1001),), pids=(555,)),
    Tenant(name="both", match=(MatchRule(uid=1002, cgroup="/batch/*"),)),
    Tenant(name="users", match=(MatchRule(uid=1001), MatchRule(cgroup="/user.slice/*"))),
)


def test_rule_by_cgroup_glob() -> None:
    assert resolve(opener(cgroup="/kubepods/burstable/pod-abc/ctr"), TENANTS, {}, None) == "pods"
    assert resolve(opener(cgroup="/kubepods/pod-abc"), TENANTS, {}, None) is None


def test_first_matching_tenant_in_order_wins() -> None:
    # uid 1001 matches both bob and users: bob comes first
    assert resolve(opener(uid=1001), TENANTS, {}, None) == "bob"
    assert resolve(opener(uid=1001), TENANTS[::-1], {}, None) == "users"


def test_rule_fields_are_anded() -> None:
    assert resolve(opener(uid=1002, cgroup="/batch/x"), TENANTS, {}, None) == "both"
    assert resolve(opener(uid=1002, cgroup="/other/x"), TENANTS, {}, None) is None
    assert resolve(opener(uid=1003, cgroup="/batch/x"), TENANTS, {}, None) is None


def test_cgroup_glob_is_case_sensitive() -> None:
    assert resolve(opener(cgroup="/USER.SLICE/x"), TENANTS, {}, None) is None


def test_binding_beats_rules() -> None:
    # tgid 555 with the cgroup of "users", bound to pods
    assert resolve(opener(tgid=555), TENANTS, {555: Binding("pods", 5)}, None) == "pods"
    assert resolve(opener(tgid=100), TENANTS, {100: Binding("both", 5)}, "users") == "both"


def test_binding_names_one_process_not_a_pid() -> None:
    """Item 15 of issue 10: a later process given the same pid (after an exit,
    or in the next boot) is not bound; nor an opener whose start is unknown."""
    bound = {555: Binding("pods", 5)}
    # not the bound process: the rules decide (users matches its cgroup)
    assert resolve(opener(tgid=555, start=6), TENANTS, bound, None) == "users"
    assert resolve(opener(tgid=555, start=None), TENANTS, bound, None) == "users"
    assert resolve(opener(tgid=555, start=5), TENANTS, bound, None) == "pods"


def test_binding_is_by_tgid_not_thread_pid() -> None:
    o = Opener(pid=555, tgid=100, uid=0, gid=0, cgroup_id=1, cgroup_path="/", start=5)
    assert resolve(o, TENANTS, {555: Binding("pods", 5)}, None) is None


def test_start_ticks_is_the_kernels_conversion() -> None:
    assert start_ticks(0) == 0
    assert start_ticks(9_999_999) == 0
    assert start_ticks(10_000_000) == 1
    assert start_ticks(123_456_789_012) == 12_345


def test_default_then_refuse() -> None:
    o = opener(uid=0, cgroup="/system.slice/x")
    assert resolve(o, TENANTS, {}, "users") == "users"
    assert resolve(o, TENANTS, {}, None) is None
    assert resolve(o, (), {}, None) is None


# --- cgroup bindings ---

POD = CgroupBinding("pods", "/machine.slice/pod-a", 70)
CTR = CgroupBinding("bob", "/machine.slice/pod-a/ctr-1", 71)


def in_cgroup(path: str, cgroup_id: int, tgid: int = 100, uid: int = 1000) -> Opener:
    return Opener(pid=tgid, tgid=tgid, uid=uid, gid=uid, cgroup_id=cgroup_id,
                  cgroup_path=path, start=5)


def by_path(*bindings: CgroupBinding) -> dict[str, CgroupBinding]:
    return {b.path: b for b in bindings}


def live(*bindings: CgroupBinding) -> dict[str, int]:
    """A cgroup tree where the bound cgroups exist: path -> id."""
    return {b.path: b.cgroup_id for b in bindings}


def test_a_cgroup_binding_claims_its_cgroup_and_its_descendants() -> None:
    tree = live(POD)
    for o in (in_cgroup("/machine.slice/pod-a", 70), in_cgroup("/machine.slice/pod-a/x", 99),
              in_cgroup("/machine.slice/pod-a/x/y/z", 98, uid=1001)):
        assert resolve(o, TENANTS, {}, "users", by_path(POD), tree.get) == "pods"
    # By component: a sibling whose name starts the same is not below it.
    assert resolve(in_cgroup("/machine.slice/pod-ab", 72, uid=1001), TENANTS, {}, None,
                   by_path(POD), tree.get) == "bob"
    assert resolve(in_cgroup("/machine.slice", 2), TENANTS, {}, None, by_path(POD),
                   tree.get) is None


def test_a_cgroup_binding_of_a_removed_cgroup_holds_for_nothing_at_its_path() -> None:
    # The bound cgroup (id 70) was removed; a new one (id 80) was made at its path.
    tree = {"/machine.slice/pod-a": 80}
    assert resolve(in_cgroup("/machine.slice/pod-a", 80), TENANTS, {}, "users", by_path(POD),
                   tree.get) == "users"
    assert resolve(in_cgroup("/machine.slice/pod-a/x", 81), TENANTS, {}, "users", by_path(POD),
                   tree.get) == "users"
    assert resolve(in_cgroup("/machine.slice/pod-a/x", 81), TENANTS, {}, "users", by_path(POD),
                   {}.get) == "users"  # nothing there now


def test_precedence_pid_then_cgroup_then_rules_then_default() -> None:
    o = in_cgroup("/machine.slice/pod-a/ctr-1/sub", 90, tgid=555, uid=1001)
    tree = live(POD, CTR)
    assert resolve(o, TENANTS, {555: Binding("both", 5)}, "users", by_path(POD, CTR),
                   tree.get) == "both"
    assert resolve(o, TENANTS, {}, "users", by_path(POD, CTR), tree.get) == "bob"  # the deepest
    assert resolve(o, TENANTS, {}, "users", by_path(POD), tree.get) == "pods"  # over rule "bob"
    assert resolve(o, TENANTS, {}, "users", {}, tree.get) == "bob"  # uid 1001's rule
    # A dead inner binding falls back to the live outer one.
    assert resolve(o, TENANTS, {}, "users", by_path(POD, CTR), live(POD).get) == "pods"


_COMPONENT = st.sampled_from(["a", "b", "ab", "a.b", "c"])
_PATH = st.lists(_COMPONENT, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))


@given(bound=st.lists(st.tuples(_PATH, st.booleans()), max_size=4, unique_by=lambda b: b[0]),
       path=_PATH, pid_bound=st.booleans(), uid=st.sampled_from([1000, 1001]))
def test_cgroup_resolution_against_a_model(bound: list[tuple[str, bool]], path: str,
                                           pid_bound: bool, uid: int) -> None:
    """A model of the rules: the pid binding wins; else the deepest live bound
    cgroup equal to the opener's or a component-wise ancestor of it; else
    the rules, else the default. Ids: a cgroup's id is its path's hash, a
    binding is live when it was made of that id."""
    ids = {p: abs(hash(p)) % 1000 + 1 for p, _ in bound} | {path: abs(hash(path)) % 1000 + 1}
    bindings = [CgroupBinding(f"t{i}", p, ids[p] if alive else ids[p] + 5000)
                for i, (p, alive) in enumerate(bound)]
    o = in_cgroup(path, ids[path], tgid=555, uid=uid)
    pids = {555: Binding("both", 5)} if pid_bound else {}
    got = resolve(o, TENANTS, pids, "users", by_path(*bindings), ids.get)

    def above(b: CgroupBinding) -> bool:
        return path.split("/")[: b.path.count("/") + 1] == b.path.split("/")

    claims = [b for b in bindings if above(b) and ids[b.path] == b.cgroup_id]
    if pid_bound:
        assert got == "both"
    elif claims:
        assert got == max(claims, key=lambda b: b.path.count("/")).tenant
    else:
        assert got == ("bob" if uid == 1001 else "users")
