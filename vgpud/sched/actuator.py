"""Actuators: turn channel groups' scheduling on and off, set their timeslices
and preempt them.

The module actuator is the one built: VGPU_CMD_SCHEDULE (GenlChannel.schedule)
makes the module issue NVA06C_CTRL_CMD_GPFIFO_SCHEDULE {bEnable} on each group
through its owner's backing nvidiactl file, in the order given, and answer one
result per entry. GPFIFO_SCHEDULE is a non-privileged control of the owning
client, so no privilege beyond the module's is needed, and nvsim checks it as
the driver does.

The privileged device-wide alternative, NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS
(0x2080110B, on a subdevice of a client of our own, lists of up to 64 client
and channel handles per call) is not built: it names channels, not groups (the
daemon would have to learn every channel alloc too: GPFIFO classes differ per
GPU generation), it needs a privileged RM client the daemon would own on the
real driver, and its semantics for channels inside a TSG are not visible in
the open code (docs nvidia-abi-facts: U). It would plug in here as another
Actuator: ``apply`` gets the same ordered entries, and would map each group
to its channels and issue one control per 64 of them.

Since protocol v7 the same command carries two more ops (``timeslice_entries``,
``preempt_entries``): TIMESLICE (NVA06C_CTRL_CMD_SET_TIMESLICE, ``arg`` us) and
PREEMPT (NVA06C_CTRL_CMD_PREEMPT, bWait 0), issued the same way in the owner's
client context. Their caller (the scheduler service, through its SchedActuator)
needs each entry's outcome (a driver that refuses timeslice changes sends the
daemon back to frame mode), so ``ModuleActuator.run`` returns the results, one
per entry, besides counting them.
Protocol v8 adds INTERLEAVE (NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL, ``arg`` the
level), which the driver allows a caller with CAP_SYS_NICE: the module issues
it in the daemon's process.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from vgpud.kernel import uapi
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.nvidia.escapes import NvStatus

__all__ = ["Actuator", "ActuatorStats", "GroupRef", "ModuleActuator", "ScheduleChannel",
           "level_entries", "preempt_entries", "timeslice_entries"]

log = logging.getLogger(__name__)

LOG_INTERVAL = 10.0  # seconds between two warnings about failed entries
# The group or its client went away before the entry reached it.
GONE_STATUSES = frozenset({0x23, 0x33})  # NV_ERR_INVALID_CLIENT, NV_ERR_INVALID_OBJECT_HANDLE
ARG_MAX = 0xFFFF_FFFF  # struct vgpu_sched's arg is a __u32


class GroupRef(NamedTuple):
    """A channel group as SCHEDULE names it: its owner's context, client, handle."""

    ctx_id: int
    h_client: int
    h_object: int


def timeslice_entries(slices: Iterable[tuple[GroupRef, int]]) -> list[Sched]:
    """TIMESLICE entries, in order. The driver judges each value (nvsim and the
    driver refuse one below their minimum with NV_ERR_NOT_SUPPORTED); only what
    the u32 ``arg`` cannot carry is refused here, with ValueError."""
    return _arg_entries(SchedState.TIMESLICE, slices)


def level_entries(levels: Iterable[tuple[GroupRef, int]]) -> list[Sched]:
    """INTERLEAVE entries, in order; the driver judges each level (as above)."""
    return _arg_entries(SchedState.INTERLEAVE, levels)


def _arg_entries(op: SchedState, args: Iterable[tuple[GroupRef, int]]) -> list[Sched]:
    out = []
    for group, arg in args:
        if not 0 <= arg <= ARG_MAX:
            raise ValueError(f"{op.name} {arg} of group {group.h_object:#x}: not a u32")
        out.append(Sched(*group, op, arg))
    return out


def preempt_entries(groups: Iterable[GroupRef]) -> list[Sched]:
    """PREEMPT entries, in order: each running group's slice ends at once."""
    return [Sched(*group, SchedState.PREEMPT) for group in groups]


class ScheduleChannel(Protocol):
    """The part of GenlChannel an actuator uses."""

    async def schedule(self, entries: Sequence[Sched]) -> list[SchedResult]: ...


@dataclass(slots=True)
class ActuatorStats:
    calls: int = 0
    entries: int = 0
    failed: int = 0  # entries the driver or the module refused
    gone: int = 0  # entries whose context or group had just gone (closes racing switches)
    errors: int = 0  # calls that got no answer (channel closed, timeout)
    timeslices: int = 0  # TIMESLICE entries sent
    preempts: int = 0  # PREEMPT entries sent
    levels: int = 0  # INTERLEAVE entries sent
    latency_ns: deque[int] = field(default_factory=lambda: deque(maxlen=100_000))
    # the latest calls' send-to-reply times

    def counts(self) -> dict[str, int]:
        return {"calls": self.calls, "entries": self.entries, "failed": self.failed,
                "gone": self.gone, "errors": self.errors, "timeslices": self.timeslices,
                "preempts": self.preempts, "levels": self.levels}


class Actuator(Protocol):
    stats: ActuatorStats

    async def apply(self, entries: Sequence[Sched]) -> None:
        """Apply ``entries`` in order; failures are counted and logged, never raised."""
        ...


class ModuleActuator:
    """Entries go to the module in calls of at most SCHED_MAX."""

    def __init__(self, channel: ScheduleChannel) -> None:
        self.channel = channel
        self.stats = ActuatorStats()
        self._last_warning = 0.0

    async def apply(self, entries: Sequence[Sched]) -> None:
        await self.run(entries)

    async def run(self, entries: Sequence[Sched]) -> list[SchedResult | None]:
        """As ``apply``, and each entry's result (None: its call got no answer)."""
        stats = self.stats
        out: list[SchedResult | None] = []
        for start in range(0, len(entries), uapi.SCHED_MAX):
            chunk = entries[start:start + uapi.SCHED_MAX]
            stats.calls += 1
            stats.entries += len(chunk)
            stats.timeslices += sum(e.enable == SchedState.TIMESLICE for e in chunk)
            stats.preempts += sum(e.enable == SchedState.PREEMPT for e in chunk)
            stats.levels += sum(e.enable == SchedState.INTERLEAVE for e in chunk)
            t0 = time.monotonic_ns()
            try:
                results = await self.channel.schedule(chunk)
            except Exception as exc:  # the channel's errors, and anything it raises
                stats.errors += 1
                self._warn("schedule of %d entries failed: %s", len(chunk), exc)
                out += [None] * len(chunk)
                continue
            stats.latency_ns.append(time.monotonic_ns() - t0)
            out += self._check(chunk, results)
        return out

    def _check(self, chunk: Sequence[Sched],
               results: Sequence[SchedResult]) -> list[SchedResult | None]:
        stats = self.stats
        if len(results) != len(chunk):
            stats.failed += len(chunk)
            self._warn("schedule: %d results for %d entries", len(results), len(chunk))
            return [None] * len(chunk)
        for entry, result in zip(chunk, results, strict=True):
            if result.error == 0 and result.status == NvStatus.OK:
                continue
            if result.error == -errno.ENOENT or result.status in GONE_STATUSES:
                stats.gone += 1
                log.debug("schedule %s: gone (%s)", entry, result)
                continue
            stats.failed += 1
            self._warn("schedule of group %#x (client %#x, context %d, %s) failed: "
                       "errno %d, NVIDIA status %#x", entry.h_object, entry.h_client,
                       entry.ctx_id, SchedState(entry.enable).name, -result.error,
                       result.status)
        return list(results)

    def _warn(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= LOG_INTERVAL:
            self._last_warning = now
            log.warning(fmt + " (%d failed so far)", *args, self.stats.failed + self.stats.errors)
        else:
            log.debug(fmt, *args)
