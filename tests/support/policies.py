"""Test policies without state, and the test daemon's --policy and --filter
values: AllowAll, DenyClasses, ``parse_policy``, ``parse_filter_spec``.

Tests only (tests.support.testdaemon runs them): vgpud itself runs the quota
policy alone (vgpud.app).
"""

from __future__ import annotations

from collections.abc import Iterable

from vgpud.kernel.codec import Event
from vgpud.kernel.uapi import ALLOW, FILTER_OPEN, Filter, Verdict
from vgpud.nvidia.escapes import NvStatus
from vgpud.nvidia.layouts import RmAlloc
from vgpud.policy.base import Policy, Request
from vgpud.policy.rules import rm_alloc_classes, rm_control_cmds

__all__ = ["AllowAll", "DenyClasses", "parse_filter_spec", "parse_policy"]


class AllowAll:
    """Allows everything; needs no rules (the test daemon adds any from --filter)."""

    def filter(self) -> Filter:
        return Filter()

    def decide(self, request: Request) -> Verdict:
        return ALLOW

    def decide_post(self, request: Request) -> Verdict:
        return ALLOW

    def on_event(self, event: Event) -> None:
        pass


class DenyClasses:
    """Test policy: RM_ALLOC of ``classes`` fails with ``status`` in the caller's params.

    The default status, NV_ERR_NO_MEMORY, makes the call look like a real
    out-of-memory, as a quota denial will.
    """

    def __init__(self, classes: Iterable[int], status: int = NvStatus.NO_MEMORY) -> None:
        self.classes = frozenset(classes)
        self.status = status
        self._verdicts: dict[int, Verdict] = {}  # by status offset

    def filter(self) -> Filter:
        return Filter(rules=rm_alloc_classes(self.classes))

    def decide(self, request: Request) -> Verdict:
        call = request.call
        if type(call) is RmAlloc and call.h_class in self.classes:
            verdict = self._verdicts.get(call.status_off)
            if verdict is None:
                verdict = Verdict.fail_status(self.status, call.status_off)
                self._verdicts[call.status_off] = verdict
            return verdict
        return ALLOW

    def decide_post(self, request: Request) -> Verdict:
        return ALLOW

    def on_event(self, event: Event) -> None:
        pass


def parse_policy(spec: str) -> Policy:
    """``allow`` or ``deny-class:0x40[,0x3f…]`` (the test daemon's --policy)."""
    name, _, args = spec.partition(":")
    if name == "allow" and not args:
        return AllowAll()
    if name == "deny-class" and args:
        return DenyClasses(int(v, 0) for v in args.split(","))
    raise ValueError(f"bad policy {spec!r}: expected allow or deny-class:CLASSES")


def parse_filter_spec(spec: str) -> Filter:
    """Parse a test daemon's ``--filter``: ``open``, ``alloc:0x40,0x3f`` or ``control:0xa06c0101``.

    ``alloc+shadow:...`` and ``control+shadow:...`` ask for shadow calls.
    """
    kind, _, values = spec.partition(":")
    if kind == "open" and not values:
        return Filter(flags=FILTER_OPEN)
    kind, plus, flag = kind.partition("+")
    if plus and flag != "shadow":
        raise ValueError(f"bad filter {spec!r}: the only option is +shadow")
    shadow = bool(plus)
    numbers = [int(v, 0) for v in values.split(",") if v]
    if kind == "alloc":
        return Filter(rules=rm_alloc_classes(numbers, shadow=shadow))
    if kind == "control":
        return Filter(rules=(rm_control_cmds(numbers, shadow=shadow),))
    raise ValueError(f"bad filter {spec!r}: expected open, alloc[+shadow]:CLASSES or "
                     "control[+shadow]:CMDS")
