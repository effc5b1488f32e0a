"""Policies: what the daemon answers to each upcall (sans-I/O).

A policy names the filter it needs (which calls the module should send up),
decides each request (OPEN, IOCTL and MMAP upcalls), decides POST upcalls (the
driver has returned: keep its results or REPLY with others), and sees the
events that follow allowed calls. It never does I/O; the daemon hands it
requests and sends its verdicts. The quota policy is vgpud.quota.QuotaPolicy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from vgpud.kernel.codec import Event, Upcall
from vgpud.kernel.uapi import ALLOW, Filter, MmapParams, Verdict
from vgpud.nvidia.escapes import NvStatus
from vgpud.nvidia.layouts import Call, RmAlloc
from vgpud.nvidia.rules import rm_alloc_classes

__all__ = ["AllowAll", "Decoded", "DenyClasses", "Policy", "Request", "parse_policy"]

Decoded = Call | MmapParams | None


class Request:
    """An upcall and its decode, made on first access of ``call`` (AllowAll never
    reads it): for IOCTL and POST upcalls of RM escapes on the ctl/GPU nodes the
    NVIDIA-level call, for MMAP upcalls struct vgpu_mmap_params."""

    __slots__ = ("_call", "_decode", "upcall")

    def __init__(self, upcall: Upcall, decode: Callable[[Upcall], Decoded]) -> None:
        self.upcall = upcall
        self._decode: Callable[[Upcall], Decoded] | None = decode
        self._call: Decoded = None

    @property
    def call(self) -> Decoded:
        """None: nothing we decode, or params that did not."""
        decode = self._decode
        if decode is not None:
            self._decode = None
            self._call = decode(self.upcall)
        return self._call


class Policy(Protocol):
    def filter(self) -> Filter:
        """The rules and flags this policy needs installed in the module."""
        ...

    def decide(self, request: Request) -> Verdict:
        """OPEN, IOCTL and MMAP upcalls."""
        ...

    def decide_post(self, request: Request) -> Verdict:
        """POST upcalls (after an ALLOW with VERDICT_F_POST): ALLOW or REPLY."""
        ...

    def on_event(self, event: Event) -> None: ...


class AllowAll:
    """Allows everything; needs no rules (the daemon adds any from --filter)."""

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
    """``allow`` or ``deny-class:0x40[,0x3f…]`` (the --policy option; ``quota``
    needs the config and is built by the daemon)."""
    name, _, args = spec.partition(":")
    if name == "allow" and not args:
        return AllowAll()
    if name == "deny-class" and args:
        return DenyClasses(int(v, 0) for v in args.split(","))
    raise ValueError(f"bad policy {spec!r}: expected allow or deny-class:CLASSES")
