"""A logging filter that bounds how often one kind of message is written.

Every refused call is logged, and a hostile tenant can make thousands a
second: unbounded, those lines cost the event loop and fill the journal,
whose own rate limit then drops the lines of everyone else. A kind is the
message's logger and template with its string arguments (the tenant's
name, mostly): each tenant has its own budget, and numbers (upcall ids,
sizes) do not make kinds. The first record after a window that dropped some
says how many.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateLimit"]

Kind = tuple[str, str, tuple[str, ...]]


@dataclass(slots=True)
class _Window:
    start: float
    passed: int = 0
    dropped: int = 0


class RateLimit(logging.Filter):
    """At most ``burst`` records of one kind per ``period`` seconds; at most
    ``kinds`` kinds remembered (past that, the oldest windows are forgotten)."""

    def __init__(self, burst: int = 10, period: float = 10.0, kinds: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.period, self.kinds, self.clock = burst, period, kinds, clock
        self._windows: dict[Kind, _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        kind = (record.name, str(record.msg), tuple(a for a in args if isinstance(a, str)))
        now = self.clock()
        w = self._windows.get(kind)
        if w is None or now - w.start >= self.period:
            dropped = w.dropped if w is not None else 0
            if w is None and len(self._windows) >= self.kinds:
                self._forget(now)
            w = self._windows[kind] = _Window(now)
            if dropped and isinstance(record.args, tuple):
                record.msg = f"{record.msg} (%d like it dropped in the last {self.period:g} s)"
                record.args = (*args, dropped)
        if w.passed >= self.burst:
            w.dropped += 1
            return False
        w.passed += 1
        return True

    def _forget(self, now: float) -> None:
        """Drops the windows that have ended, or else the older half."""
        live = {k: w for k, w in self._windows.items() if now - w.start < self.period}
        if len(live) >= self.kinds:
            live = dict(sorted(live.items(), key=lambda kw: kw[1].start)[self.kinds // 2:])
        self._windows = live
