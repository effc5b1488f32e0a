"""The daemon's log rate limit: a hostile tenant's refusals cannot flood the log."""

from __future__ import annotations

import logging

from vgpud.lograte import RateLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("vgpud.policy.quota", logging.INFO, __file__, 1, msg, args, None)


REFUSED = "upcall %d: %s allocates class %#x: refused"


def test_one_kind_is_bounded_per_tenant_and_says_what_it_dropped() -> None:
    clock = Clock()
    limit = RateLimit(burst=10, period=10.0, clock=clock)
    passed = [limit.filter(record(REFUSED, uid, "a", 0x42)) for uid in range(1000)]
    assert sum(passed) == 10 and passed[:10] == [True] * 10
    # Another tenant, and another message of the same tenant, have their own budget.
    assert limit.filter(record(REFUSED, 1, "b", 0x42))
    assert limit.filter(record("quota: %s asked %d bytes: refused", "a", 4096))
    clock.now = 10.0
    r = record(REFUSED, 1001, "a", 0x42)
    assert limit.filter(r)
    assert r.getMessage() == ("upcall 1001: a allocates class 0x42: refused "
                              "(990 like it dropped in the last 10 s)")
    assert limit.filter(record(REFUSED, 1002, "a", 0x42))  # the new window's second
    clock.now = 20.0
    quiet = record(REFUSED, 1003, "a", 0x42)
    assert limit.filter(quiet) and "dropped" not in quiet.getMessage()


def test_the_kinds_it_remembers_are_bounded() -> None:
    clock = Clock()
    limit = RateLimit(burst=1, period=10.0, kinds=8, clock=clock)
    for i in range(100):
        assert limit.filter(record("tenant %s opened", f"t{i}"))
        clock.now += 0.01
        assert len(limit._windows) <= 8
    # A kind still in its window keeps its count when others are forgotten.
    assert not limit.filter(record("tenant %s opened", "t99"))


def test_records_without_tuple_args_pass() -> None:
    limit = RateLimit(burst=1, clock=Clock())
    r = logging.LogRecord("x", logging.INFO, __file__, 1, "%(a)s", None, None)
    r.args = {"a": 1}
    assert limit.filter(r) and r.getMessage() == "1"
    assert not limit.filter(r)
