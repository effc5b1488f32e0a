"""The Dispatcher: the sans-I/O core of the upcall path, typed messages in,
verdicts out, whatever the policy does (it never raises)."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vgpud.kernel.codec import DecodeError, Event, Upcall
from vgpud.kernel.uapi import (
    ALLOW,
    MmapParams,
    Node,
    ObjQuery,
    ObjResult,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.kernel.verdicts import Sent, check
from vgpud.nvidia.layouts import decode_call
from vgpud.policy.base import Decoded, Policy, Request

__all__ = ["LATENCY_SLOTS", "Counters", "Dispatcher", "VerdictStats"]

log = logging.getLogger("vgpud")


@dataclass(slots=True)
class Counters:
    upcalls: int = 0
    verdicts: int = 0
    events: int = 0
    malformed: int = 0  # messages that did not decode
    unanswered: int = 0  # malformed upcalls whose id was unreadable
    call_errors: int = 0  # RM params that did not decode (the policy saw call=None)
    policy_errors: int = 0  # policy raised or gave an unusable verdict


# Verdict latency slots: slot i counts decisions of 2**(i-1) <= ns < 2**i (slot 0: 0 ns),
# the last one everything from 2**(LATENCY_SLOTS-2) ns (about 33 ms) up.
LATENCY_SLOTS = 27


@dataclass(slots=True)
class VerdictStats:
    """Verdicts by action and the time from an upcall to its verdict, as plain
    ints updated in place (no allocation per upcall), for the metrics."""

    by_action: list[int] = field(default_factory=lambda: [0] * (max(VerdictAction) + 1))
    latency: list[int] = field(default_factory=lambda: [0] * LATENCY_SLOTS)
    latency_sum_ns: int = 0

    def record(self, verdict: Verdict, started_ns: int, now_ns: int) -> None:
        spent = now_ns - started_ns
        self.by_action[verdict.action] += 1
        self.latency[min(spent.bit_length(), LATENCY_SLOTS - 1)] += 1
        self.latency_sum_ns += spent


class Dispatcher:
    """Sans-I/O core of the upcall path: typed messages in, verdicts out.

    OPEN, IOCTL and MMAP upcalls go to ``policy.decide``, POST upcalls to
    ``policy.decide_post``; MMAP params are decoded as struct vgpu_mmap_params.

    It never raises. Failures are counted, logged and answered with a safe
    verdict, fail-closed unless ``fail_open``:
    - the policy raises or returns a verdict that does not fit the upcall:
      DENY(EIO) (fail-open: ALLOW); for a POST upcall always ALLOW (the call
      has happened: keep the driver's results);
    - an upcall does not decode but its id can be read: DENY(EPROTO)
      (fail-open: ALLOW); one whose id is unreadable cannot be answered, and
      the module's timeout and fail policy complete it;
    - RM params do not decode: the policy still decides, with ``call=None``
      (the driver itself rejects a malformed params block).

    The params are decoded when the policy first reads ``Request.call``.
    """

    def __init__(self, policy: Policy, *, fail_open: bool = False,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        """``clock`` (ns): what the verdict latency is measured with."""
        self.policy = policy
        self.counters = Counters()
        self.verdict_stats = VerdictStats()
        self._clock = clock
        self._on_policy_error = ALLOW if fail_open else Verdict.deny(errno.EIO)
        self._on_malformed = ALLOW if fail_open else Verdict.deny(errno.EPROTO)

    def on_upcall(self, upcall: Upcall) -> Verdict | ObjQuery:
        """The verdict, or (POST upcalls) an ObjQuery whose resume gives it."""
        started = self._clock()
        counters = self.counters
        counters.upcalls += 1
        kind = upcall.kind
        try:
            if kind is _POST:
                verdict = self.policy.decide_post(Request(upcall, self._decode))
                if isinstance(verdict, ObjQuery):
                    return self._guard(upcall, verdict, started)
            else:
                verdict = self.policy.decide(Request(upcall, self._decode))
            if verdict is not ALLOW:
                _check(verdict, upcall)
        except Exception:
            counters.policy_errors += 1
            log.exception("policy failed on upcall %d", upcall.id)
            verdict = ALLOW if kind is _POST else self._on_policy_error
        counters.verdicts += 1
        self.verdict_stats.record(verdict, started, self._clock())
        return verdict

    def _guard(self, upcall: Upcall, query: ObjQuery, started: int) -> ObjQuery:
        """The same query, whose resume is checked as a verdict is and never raises;
        the verdict's latency counts from ``started``, when the upcall came."""

        def resume(results: Sequence[ObjResult] | None) -> Verdict | ObjQuery:
            try:
                answer = query.resume(results)
                if isinstance(answer, ObjQuery):
                    return self._guard(upcall, answer, started)
                if answer is not ALLOW:
                    _check(answer, upcall)
            except Exception:
                self.counters.policy_errors += 1
                log.exception("policy failed on the truth of upcall %d", upcall.id)
                answer = ALLOW  # a POST upcall: the call has happened
            self.counters.verdicts += 1
            self.verdict_stats.record(answer, started, self._clock())
            return answer

        return ObjQuery(query.ops, resume)

    def _decode(self, upcall: Upcall) -> Decoded:
        """The decode behind ``Request.call``, run when a policy first reads it."""
        kind = upcall.kind
        try:
            if (kind is _IOCTL or kind is _POST) and upcall.node is not _UVM:
                return decode_call(upcall.nr, upcall.params, upcall.data)
            if kind is _MMAP:
                return MmapParams.unpack(upcall.params)
        except DecodeError as exc:
            self.counters.call_errors += 1
            log.warning("upcall %d: %s params: %s", upcall.id,
                        "mmap" if kind is _MMAP else f"escape {upcall.nr:#x}", exc)
        return None

    def on_event(self, event: Event) -> None:
        self.counters.events += 1
        try:
            self.policy.on_event(event)
        except Exception:
            self.counters.policy_errors += 1
            log.exception("policy failed on %s", type(event).__name__)

    def on_malformed(self, error: DecodeError) -> Verdict | None:
        self.counters.malformed += 1
        if error.upcall_id is None:
            self.counters.unanswered += 1
            log.warning("malformed message: %s", error)
            return None
        log.warning("malformed upcall %d: %s", error.upcall_id, error)
        self.counters.verdicts += 1
        self.verdict_stats.by_action[self._on_malformed.action] += 1
        return self._on_malformed


_IOCTL, _POST, _MMAP, _UVM = UpcallKind.IOCTL, UpcallKind.POST, UpcallKind.MMAP, Node.UVM


def _check(verdict: Verdict, upcall: Upcall) -> None:
    """Refuse verdicts the module would refuse (the caller would then wait in vain)."""
    if type(verdict) is not Verdict:
        raise TypeError(f"policy returned {verdict!r}, not a Verdict")
    check(verdict, Sent(upcall.kind, upcall.nr, len(upcall.params),
                        0 if upcall.data is None else len(upcall.data),
                        0 if upcall.data2 is None else len(upcall.data2)))
