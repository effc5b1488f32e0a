"""Mirror of kmod/include/uapi/linux/vgpu.h (protocol v6).

Kept in agreement with the header by tests/unit/test_uapi_header.py (values)
and tests/unit/test_uapi_layout.py (sizes and offsets, from gcc).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from vgpud.kernel.cstruct import CStruct

GENL_NAME = "vgpu"
GENL_VERSION = 1
PROTO_VERSION = 8

OFF_NONE = 0xFFFFFFFF
RULE_MATCH_MAX = 32
RULES_MAX = 32
PARAMS_MAX = 16384

RULE_F_POST = 1 << 0  # a POST event after each allowed call the rule selects
RULE_F_SHADOW = 1 << 1  # the driver reads the module's checked copy of the blocks
RULE_F_LEN_FIXED = 1 << 2  # v6: len_off is the buffer's length, not an offset
FILTER_OPEN = 1 << 0
FILTER_UVM_MMAP = 1 << 1

UPCALL_F_XFER = 1 << 0
UPCALL_F_DATA_FAULT = 1 << 1
UPCALL_F_DATA_BIG = 1 << 2
UPCALL_F_DATA2_FAULT = 1 << 3  # the nested list could not be read
UPCALL_F_DATA2_BIG = 1 << 4  # the nested list's count is over its max

VERDICT_F_POST = 1 << 0
VERDICT_F_SCHED_OFF = 1 << 1  # ALLOW of RM_ALLOC: a new channel group is made off

LIST_MAX = 1024  # contexts in one LIST_CONTEXTS reply
SCHED_MAX = 256  # entries in one SCHEDULE request
OBJ_MAX = 64  # operations in one OBJECT request
NESTED_MAX = 256  # entries of one nested list

ERRNO_MAX = 511  # the kernel's own 512.. are internal


class Node(IntEnum):
    CTL = 0
    GPU = 1
    UVM = 2


class UpcallKind(IntEnum):
    OPEN = 1
    IOCTL = 2
    POST = 3
    MMAP = 4


class VerdictAction(IntEnum):
    ALLOW = 1
    DENY = 2
    FAIL_STATUS = 3
    REPLY = 4


class EventKind(IntEnum):
    POST = 1
    CLOSE = 2
    ABANDONED = 3  # the module gave up on an upcall: no verdict will be taken
    REVOKED = 4  # a context was revoked


class RevokeReason(IntEnum):
    """enum vgpu_revoke_reason: a REVOKED event's ``nr``."""

    DAEMON = 1  # VGPU_CMD_REVOKE
    SHADOW = 2  # a shadow was unmapped or replaced during the call
    RECHECK = 3  # params changed under a forwarded call


class Cmd(IntEnum):
    UNSPEC = 0
    REGISTER = 1
    SET_FILTER = 2
    GET_STATS = 3
    UPCALL = 4
    VERDICT = 5
    EVENT = 6
    UNREGISTER = 7
    LIST_CONTEXTS = 8
    SCHEDULE = 9
    OBJECT = 10
    REVOKE = 11


CMD_MAX = max(Cmd)


class Attr(IntEnum):
    UNSPEC = 0
    VERSION = 1
    FILTER_FLAGS = 2
    RULES = 3
    STATS = 4
    UPCALL = 5
    PARAMS = 6
    DATA = 7
    CGROUP = 8
    VERDICT = 9
    EVENT = 10
    CURSOR = 11
    CONTEXTS = 12
    SCHED = 13
    SCHED_RESULT = 14
    OBJ = 15
    OBJ_RESULT = 16
    CTX_ID = 17
    NESTED = 18
    DATA2 = 19
    OPENER = 20
    OPENERS = 21
    STATS4 = 22


ATTR_MAX = max(Attr)

RULE = CStruct(
    "vgpu_rule",
    ("node_mask", "I"),
    ("nr", "I"),
    ("size", "I"),
    ("match_off", "I"),
    ("ptr_off", "I"),
    ("len_off", "I"),
    ("n_match", "I"),
    ("flags", "I"),
    ("match", f"{RULE_MATCH_MAX}I"),
)

UPCALL = CStruct(
    "vgpu_upcall",
    ("id", "Q"),
    ("ctx_id", "Q"),
    ("cgroup_id", "Q"),
    ("kind", "I"),
    ("node", "I"),
    ("minor", "I"),
    ("cmd", "I"),
    ("nr", "I"),
    ("flags", "I"),
    ("pid", "I"),
    ("tgid", "I"),
    ("uid", "I"),
    ("gid", "I"),
    ("caller_pid", "I"),
    ("caller_tgid", "I"),
    ("ret", "i"),
    ("reserved", "I"),
)

VERDICT = CStruct(
    "vgpu_verdict",
    ("id", "Q"),
    ("action", "I"),
    ("error", "I"),
    ("status", "I"),
    ("status_off", "I"),
    ("flags", "I"),
    ("reserved", "I"),
)

MMAP_PARAMS = CStruct(
    "vgpu_mmap_params",
    ("pgoff", "Q"),
    ("length", "Q"),
    ("prot", "I"),
    ("flags", "I"),
)

EVENT = CStruct(
    "vgpu_event",
    ("ctx_id", "Q"),
    ("upcall_id", "Q"),
    ("kind", "I"),
    ("nr", "I"),
    ("ret", "i"),
    ("reserved", "I"),
)

STATS = CStruct(
    "vgpu_stats",
    ("version", "I"),
    ("daemon_portid", "I"),
    *((name, "Q") for name in (
        "contexts", "opens", "ioctls", "upcalls", "verdicts", "timeouts", "lost",
        "fail_open", "fail_closed", "killed", "events", "events_lost", "bad_verdicts",
        "mmaps",
    )),
)

CONTEXT = CStruct(
    "vgpu_context",
    ("ctx_id", "Q"),
    ("cgroup_id", "Q"),
    ("node", "I"),
    ("minor", "I"),
    ("pid", "I"),
    ("tgid", "I"),
    ("uid", "I"),
    ("gid", "I"),
)

SCHED = CStruct(
    "vgpu_sched",
    ("ctx_id", "Q"),
    ("h_client", "I"),
    ("h_object", "I"),
    ("enable", "I"),
    ("arg", "I"),  # v7: TIMESLICE's microseconds (reserved before); v8: INTERLEAVE's level
)

SCHED_RESULT = CStruct(
    "vgpu_sched_result",
    ("error", "i"),
    ("status", "I"),
)

OPENER = CStruct(
    "vgpu_opener",
    ("start_boottime_ns", "Q"),
    ("reserved", "Q"),
)

RULE_NESTED = CStruct(
    "vgpu_rule_nested",
    ("rule", "I"),
    ("ptr_off", "I"),
    ("count_off", "I"),
    ("elem_size", "I"),
    ("max_count", "I"),
    ("reserved", "I"),
)

OBJ_OP = CStruct(
    "vgpu_obj_op",
    ("ctx_id", "Q"),
    ("h_client", "I"),
    ("h_parent", "I"),
    ("h_object", "I"),
    ("op", "I"),
)

OBJ_RESULT = CStruct(
    "vgpu_obj_result",
    ("error", "i"),
    ("status", "I"),
    ("value", "Q"),
)

STATS4 = CStruct(
    "vgpu_stats4",
    *((name, "Q") for name in (
        "abandoned", "revoked", "tampered", "throttled", "proxies", "objects",
    )),
    ("reserved", "2Q"),
)

LAYOUTS = (RULE, UPCALL, VERDICT, EVENT, STATS, MMAP_PARAMS, CONTEXT, SCHED, SCHED_RESULT,
           OPENER, RULE_NESTED, OBJ_OP, OBJ_RESULT, STATS4)


@dataclass(frozen=True, slots=True)
class Rule:
    """struct vgpu_rule: one selector of the module's slow path."""

    node_mask: int
    nr: int
    size: int
    match_off: int = OFF_NONE
    ptr_off: int = OFF_NONE
    len_off: int = OFF_NONE
    match: tuple[int, ...] = ()
    post: bool = False  # VGPU_RULE_F_POST: the policy needs the call's result
    shadow: bool = False  # VGPU_RULE_F_SHADOW: the driver reads the checked blocks
    # VGPU_RULE_F_LEN_FIXED: the buffer at ptr_off is this long (sent in
    # len_off's place), the size the driver reads whatever the params say.
    data_size: int = 0

    def __post_init__(self) -> None:
        if self.data_size:
            if self.ptr_off == OFF_NONE or self.len_off != OFF_NONE:
                raise ValueError("a fixed data_size needs ptr_off and no len_off")
            if not 0 < self.data_size <= PARAMS_MAX:
                raise ValueError(f"data_size must be 1..{PARAMS_MAX}")
        elif (self.ptr_off == OFF_NONE) != (self.len_off == OFF_NONE):
            raise ValueError("ptr_off and len_off go together")
        if len(self.match) > RULE_MATCH_MAX:
            raise ValueError(f"a rule matches at most {RULE_MATCH_MAX} values")
        if self.match and self.match_off == OFF_NONE:
            raise ValueError("match values need a match_off")
        if self.shadow and self.node_mask & (1 << Node.UVM) and not self.size:
            raise ValueError("a shadow rule on the UVM node needs the params size")

    def pack(self) -> bytes:
        match = self.match + (0,) * (RULE_MATCH_MAX - len(self.match))
        return RULE.struct.pack(
            self.node_mask, self.nr, self.size, self.match_off, self.ptr_off,
            self.data_size or self.len_off, len(self.match), self.flags, *match,
        )

    @property
    def flags(self) -> int:
        """VGPU_RULE_F_* of the rule."""
        return ((RULE_F_POST if self.post else 0) | (RULE_F_SHADOW if self.shadow else 0)
                | (RULE_F_LEN_FIXED if self.data_size else 0))

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Rule:
        node_mask, nr, size, match_off, ptr_off, len_off, n_match, flags, *match = (
            RULE.unpack_exact(buf)
        )
        fixed = bool(flags & RULE_F_LEN_FIXED)
        return cls(node_mask, nr, size, match_off, ptr_off, OFF_NONE if fixed else len_off,
                   tuple(match[:n_match]), bool(flags & RULE_F_POST),
                   bool(flags & RULE_F_SHADOW), len_off if fixed else 0)


@dataclass(frozen=True, slots=True)
class Filter:
    """What the module should send up: VGPU_A_FILTER_FLAGS, VGPU_A_RULES and
    VGPU_A_NESTED (the lists behind pointers in rules' buffers, by rule index)."""

    flags: int = 0
    rules: tuple[Rule, ...] = ()
    nested: tuple[RuleNested, ...] = ()

    def __post_init__(self) -> None:
        if len(self.rules) > RULES_MAX:
            raise ValueError(f"a filter holds at most {RULES_MAX} rules")
        seen: set[int] = set()
        for n in self.nested:
            if not 0 <= n.rule < len(self.rules) or n.rule in seen:
                raise ValueError(f"nested list on rule {n.rule}: no such rule, or a second")
            if self.rules[n.rule].ptr_off == OFF_NONE:
                raise ValueError(f"nested list on rule {n.rule}, which names no buffer")
            seen.add(n.rule)

    def __add__(self, other: Filter) -> Filter:
        shift = len(self.rules)
        return Filter(self.flags | other.flags, self.rules + other.rules,
                      self.nested + tuple(n._replace(rule=n.rule + shift) for n in other.nested))


class Verdict(NamedTuple):
    """struct vgpu_verdict without its id (the channel adds the upcall's).

    ``params`` / ``data`` / ``data2`` are the blocks of a REPLY (VGPU_A_PARAMS /
    VGPU_A_DATA / VGPU_A_DATA2: the rule's nested list), each exactly as long as
    the upcall's block of that name; None leaves that block as it is. An ALLOW
    of an IOCTL upcall may carry ``params`` (v5): the driver reads those
    instead of the upcall's.
    """

    action: VerdictAction
    error: int = 0
    status: int = 0
    status_off: int = 0
    flags: int = 0
    params: bytes | None = None
    data: bytes | None = None
    data2: bytes | None = None

    @classmethod
    def deny(cls, error: int) -> Verdict:
        if not 1 <= error <= ERRNO_MAX:
            raise ValueError(f"errno out of range: {error}")
        return cls(VerdictAction.DENY, error)

    @classmethod
    def fail_status(cls, status: int, status_off: int) -> Verdict:
        if not 0 <= status <= 0xFFFFFFFF or not 0 <= status_off <= PARAMS_MAX - 4:
            raise ValueError(f"bad FAIL_STATUS {status:#x} at {status_off}")
        return cls(VerdictAction.FAIL_STATUS, 0, status, status_off)

    @classmethod
    def reply(cls, params: bytes | None = None, data: bytes | None = None,
              data2: bytes | None = None) -> Verdict:
        """REPLY: write these blocks over the caller's params / the rule's buffer /
        its nested list."""
        if params is None and data is None and data2 is None:
            raise ValueError("a REPLY carries params, data or data2")
        for block in (params, data, data2):
            if block is not None and len(block) > PARAMS_MAX:
                raise ValueError(f"REPLY block of {len(block)} bytes")
        return cls(VerdictAction.REPLY, params=params, data=data, data2=data2)


ALLOW = Verdict(VerdictAction.ALLOW)
# ALLOW, then a POST upcall (not a POST event) when the driver has returned.
ALLOW_POST = Verdict(VerdictAction.ALLOW, flags=VERDICT_F_POST)
# ALLOW an RM_ALLOC; a channel group it makes is turned off before the call returns.
ALLOW_SCHED_OFF = Verdict(VerdictAction.ALLOW, flags=VERDICT_F_SCHED_OFF)


class MmapParams(NamedTuple):
    """struct vgpu_mmap_params: the params block of an MMAP upcall."""

    pgoff: int
    length: int
    prot: int
    flags: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> MmapParams:
        return cls(*MMAP_PARAMS.unpack_exact(buf))


@dataclass(frozen=True, slots=True)
class Stats:
    """struct vgpu_stats: module counters."""

    version: int
    daemon_portid: int
    contexts: int
    opens: int
    ioctls: int
    upcalls: int
    verdicts: int
    timeouts: int
    lost: int
    fail_open: int
    fail_closed: int
    killed: int
    events: int
    events_lost: int
    bad_verdicts: int
    mmaps: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Stats:
        return cls(*STATS.unpack_exact(buf))


class Context(NamedTuple):
    """struct vgpu_context: one live context, as LIST_CONTEXTS reports it."""

    ctx_id: int
    cgroup_id: int
    node: Node
    minor: int
    pid: int
    tgid: int
    uid: int
    gid: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Context:
        ctx_id, cgroup_id, node, *rest = CONTEXT.unpack_exact(buf)
        return cls(ctx_id, cgroup_id, Node(node), *rest)


class SchedState(IntEnum):
    """enum vgpu_sched_state: what a SCHEDULE entry does to its group."""

    OFF = 0  # remembered by the module: on again if the daemon dies
    ON = 1
    OWNER_OFF = 2  # off for its owner: stays off without a daemon
    TIMESLICE = 3  # v7: SET_TIMESLICE to ``arg`` us (not remembered)
    PREEMPT = 4  # v7: PREEMPT, bWait 0 (not remembered)
    INTERLEAVE = 5  # v8: SET_INTERLEAVE_LEVEL to ``arg`` (not remembered)


class Sched(NamedTuple):
    """struct vgpu_sched: one scheduling control of one channel group.

    ``enable``: a SchedState, the op (True and False are ON and OFF);
    ``arg``: the timeslice in us for TIMESLICE, the level for INTERLEAVE, zero
    for the others."""

    ctx_id: int
    h_client: int
    h_object: int
    enable: int
    arg: int = 0

    def pack(self) -> bytes:
        return SCHED.struct.pack(self.ctx_id, self.h_client, self.h_object, int(self.enable),
                                 self.arg)


class SchedResult(NamedTuple):
    """struct vgpu_sched_result: 0 or -errno, and the driver's NVIDIA status."""

    error: int
    status: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> SchedResult:
        return cls(*SCHED_RESULT.unpack_exact(buf))


class Opener(NamedTuple):
    """struct vgpu_opener: the opening process's start time (boot clock)."""

    start_boottime_ns: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Opener:
        start, _reserved = OPENER.unpack_exact(buf)
        return cls(start)


class RuleNested(NamedTuple):
    """struct vgpu_rule_nested: a list behind a pointer in a rule's buffer."""

    rule: int  # index of the rule in the filter
    ptr_off: int  # in the rule's buffer: the list's u64 pointer
    count_off: int  # in the rule's buffer: the u32 entry count
    elem_size: int
    max_count: int

    def pack(self) -> bytes:
        return RULE_NESTED.struct.pack(*self, 0)

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> RuleNested:
        *fields, _reserved = RULE_NESTED.unpack_exact(buf)
        return cls(*fields)


class ObjOpKind(IntEnum):
    """enum vgpu_obj_op_kind: what VGPU_CMD_OBJECT asks the driver."""

    CLASS = 1  # the object's class
    PARENT = 2  # its parent's handle
    MEM_SIZE = 3  # a memory object's size in bytes
    FREE = 4  # RM_FREE of the object and its subtree


class ObjOp(NamedTuple):
    """struct vgpu_obj_op: one question to the driver about one object."""

    ctx_id: int
    h_client: int
    h_parent: int
    h_object: int
    op: ObjOpKind

    def pack(self) -> bytes:
        return OBJ_OP.struct.pack(self.ctx_id, self.h_client, self.h_parent, self.h_object,
                                  int(self.op))


class ObjResult(NamedTuple):
    """struct vgpu_obj_result: 0 or -errno, the NVIDIA status, and the answer."""

    error: int
    status: int
    value: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> ObjResult:
        return cls(*OBJ_RESULT.unpack_exact(buf))


@dataclass(frozen=True, slots=True)
class ObjQuery:
    """An answer to an upcall that first needs the driver's truth (sans-I/O).

    The adapter (the channel) runs ``ops`` in one VGPU_CMD_OBJECT request and
    calls ``resume`` with the results, one per op in order, or with None when
    the request failed; ``resume`` returns the verdict to send, or another
    ObjQuery. A policy returns one where a Verdict would go."""

    ops: tuple[ObjOp, ...]
    resume: Callable[[Sequence[ObjResult] | None], Verdict | ObjQuery]


@dataclass(frozen=True, slots=True)
class Stats4:
    """struct vgpu_stats4: the module counters added in protocol v4."""

    abandoned: int
    revoked: int
    tampered: int
    throttled: int
    proxies: int
    objects: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Stats4:
        *values, _r0, _r1 = STATS4.unpack_exact(buf)
        return cls(*values)
