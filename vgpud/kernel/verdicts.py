"""Which verdicts answer which upcalls: the module's rule, as one table (pure).

kmod/vgpu/upcall.c refuses (EINVAL) a verdict that does not fit its upcall,
and the waiter then waits in vain; the Dispatcher checks every verdict here
first, so a policy's mistake is logged and answered with the fail policy
instead. ``LEGAL`` says, per action and upcall kind, which flags and blocks
a verdict may carry; the rules no table cell can say (a block as long as the
upcall's, FAIL_STATUS inside the params, SCHED_OFF only on RM_ALLOC) follow
it in ``check``. tests/vm/test_vgpu_replies.py sends every combination to the
module and compares its answers with this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpud.kernel.uapi import (
    ERRNO_MAX,
    VERDICT_F_POST,
    VERDICT_F_SCHED_OFF,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia.escapes import Escape
from vgpud.nvidia.layouts import NVOS21, NVOS64

__all__ = ["LEGAL", "Legal", "Sent", "check"]

BLOCKS = ("params", "data", "data2")


@dataclass(frozen=True, slots=True)
class Legal:
    """What a verdict of one action may carry when it answers one upcall kind."""

    flags: int = 0
    blocks: frozenset[str] = frozenset()


_IOCTL_FLAGS = VERDICT_F_POST | VERDICT_F_SCHED_OFF
_REPLY = Legal(blocks=frozenset(BLOCKS))
A, K = VerdictAction, UpcallKind
# (action, kind) -> what it may carry; a pair not listed does not answer.
LEGAL: dict[tuple[VerdictAction, UpcallKind], Legal] = {
    (A.ALLOW, K.OPEN): Legal(),
    (A.ALLOW, K.MMAP): Legal(),
    # v5: the params the driver reads instead of the checked ones.
    (A.ALLOW, K.IOCTL): Legal(_IOCTL_FLAGS, frozenset({"params"})),
    (A.ALLOW, K.POST): Legal(),
    (A.DENY, K.OPEN): Legal(),
    (A.DENY, K.MMAP): Legal(),
    (A.DENY, K.IOCTL): Legal(),
    (A.FAIL_STATUS, K.IOCTL): Legal(),
    # v4: after the daemon undid the call (an allocation over quota freed).
    (A.FAIL_STATUS, K.POST): Legal(),
    (A.REPLY, K.IOCTL): _REPLY,
    (A.REPLY, K.POST): _REPLY,
}
del A, K

# RM_ALLOC params a VERDICT_F_SCHED_OFF fits (vgpu_sched_alloc_layout).
_ALLOC_SIZES = frozenset({NVOS21.size, NVOS64.size})


@dataclass(frozen=True, slots=True)
class Sent:
    """What an upcall carried that its verdict must fit: its kind, its nr and
    the length of each block (0: not sent)."""

    kind: UpcallKind
    nr: int
    params: int
    data: int
    data2: int


def check(verdict: Verdict, sent: Sent) -> None:
    """ValueError, saying why, if the module would refuse ``verdict`` for ``sent``."""
    action = verdict.action
    legal = LEGAL.get((action, sent.kind))
    if legal is None:
        raise ValueError(f"{action.name} does not answer a {sent.kind.name} upcall")
    if (verdict.error and action is not VerdictAction.DENY) or (
            action is VerdictAction.DENY and not 1 <= verdict.error <= ERRNO_MAX):
        raise ValueError(f"error {verdict.error} with {action.name}")
    flags = verdict.flags
    if flags & ~legal.flags:
        raise ValueError(f"flags {flags:#x} with {action.name} of a {sent.kind.name} upcall")
    if flags & VERDICT_F_SCHED_OFF and (sent.nr != Escape.RM_ALLOC
                                        or sent.params not in _ALLOC_SIZES):
        raise ValueError("VERDICT_F_SCHED_OFF answers an RM_ALLOC upcall only")
    carried = [name for name in BLOCKS if getattr(verdict, name) is not None]
    for name in carried:
        if name not in legal.blocks:
            raise ValueError(f"{name} with {action.name} of a {sent.kind.name} upcall")
        size = len(getattr(verdict, name))
        if not size or size != getattr(sent, name):
            raise ValueError(f"{name} of {size} bytes, the upcall's {getattr(sent, name)}")
    if action is VerdictAction.REPLY and not carried:
        raise ValueError("REPLY without blocks")
    if action is VerdictAction.FAIL_STATUS and verdict.status_off + 4 > sent.params:
        raise ValueError(f"FAIL_STATUS at {verdict.status_off} outside the upcall's params")
