"""The policy interface: what the daemon answers to each upcall (sans-I/O).

A policy names the filter it needs (which calls the module should send up),
decides each request (OPEN, IOCTL and MMAP upcalls), decides POST upcalls (the
driver has returned: keep its results or REPLY with others), and sees the
events that follow allowed calls. It never does I/O; the daemon hands it
requests and sends its verdicts. The daemon's policy is
vgpud.policy.sched.SchedPolicy over vgpud.policy.quota.QuotaPolicy (the tests'
stateless ones are in tests.support.policies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from vgpud.kernel.codec import Event, Upcall
from vgpud.kernel.uapi import Filter, MmapParams, ObjQuery, Verdict
from vgpud.nvidia.layouts import Call

__all__ = ["Decoded", "Policy", "Request"]

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

    def decide_post(self, request: Request) -> Verdict | ObjQuery:
        """POST upcalls (after an ALLOW with VERDICT_F_POST): ALLOW, REPLY or
        FAIL_STATUS, or an ObjQuery (the driver's truth first) that gives one."""
        ...

    def on_event(self, event: Event) -> None: ...
