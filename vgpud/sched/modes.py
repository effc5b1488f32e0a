"""The two scheduling modes of a GPU, as the SchedulerService runs them.

- ``runlist`` (the default): a vgpud.core.runlist RunlistPlanner sets each
  channel group's timeslice (NVA06C_CTRL_CMD_SET_TIMESLICE) and the GPU's own
  round robin switches between them; caps are duty cycles of GroupsOff/On,
  a priority tenant's groups are at the HIGH interleave level (the runlist
  runs them after every best-effort slice), and its new work preempts the
  best-effort groups.
- ``frame``: a vgpud.core.tdma TdmaScheduler turns whole tenants on and off
  in frames (GPFIFO_SCHEDULE), for drivers that refuse timeslice changes.
  A GPU whose driver refuses a TIMESLICE entry falls back to it.

This module holds what the service needs beyond the cores: building a core,
its actions as SCHEDULE entries in order, and the reason a reply refused a
timeslice. It does no I/O.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from vgpud.core.groups import Group
from vgpud.core.runlist import (
    LEVEL_MEDIUM,
    Action,
    Preempt,
    RunlistConfig,
    RunlistPlanner,
    SetInterleave,
    SetTimeslice,
)
from vgpud.core.tdma import MIN_SLOT_US, GroupsOff, GroupsOn, TdmaConfig, TdmaScheduler
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.nvidia.escapes import NvStatus
from vgpud.sched.actuator import (
    GONE_STATUSES,
    GroupRef,
    level_entries,
    preempt_entries,
    timeslice_entries,
)

__all__ = ["DEFAULT_TIMESLICE_US", "FRAME", "RUNLIST", "Core", "Mode", "describe",
           "frame_config", "refusal", "restore_entries", "runlist_config", "to_entries"]

log = logging.getLogger(__name__)

Mode = Literal["runlist", "frame"]
RUNLIST: Mode = "runlist"
FRAME: Mode = "frame"
DEFAULT_TIMESLICE_US = 1_024  # the driver's default TSG timeslice, restored at stop
Core = TdmaScheduler | RunlistPlanner


def frame_config(frame_ms: int) -> TdmaConfig:
    frame_us = frame_ms * 1000
    if frame_us < MIN_SLOT_US:
        log.warning("scheduler: frame_ms=%d is shorter than one min slot; using %d us",
                    frame_ms, MIN_SLOT_US)
        frame_us = MIN_SLOT_US
    return TdmaConfig(frame_us=frame_us, min_slot_us=MIN_SLOT_US)


def runlist_config(frame_ms: int) -> RunlistConfig:
    """The planner's defaults; frame_ms is the period of the caps' duty cycle."""
    defaults = RunlistConfig()
    return RunlistConfig(frame_us=max(frame_ms * 1000, defaults.min_timeslice_us))


def describe(mode: Mode, refused: str | None) -> str:
    """The mode as D-Bus and `vgpuctl top` show it."""
    return mode if refused is None else f"{mode} (runlist refused: {refused})"


def _ref(group: Group) -> GroupRef:
    return GroupRef(group.ctx, group.client, group.handle)


def to_entries(actions: Iterable[Action], groups: Mapping[int, Group]) -> list[Sched]:
    """The actions' SCHEDULE entries, in their order; groups the service no longer
    knows (freed while the decision was made) are left out."""
    entries: list[Sched] = []
    for action in actions:
        match action:
            case GroupsOff(groups=ids) | GroupsOn(groups=ids):
                on = isinstance(action, GroupsOn)
                entries += [Sched(g.ctx, g.client, g.handle, on)
                            for g in (groups.get(i) for i in ids) if g is not None]
            case SetTimeslice(group=gid, us=us):
                group = groups.get(gid)
                if group is not None:
                    entries += timeslice_entries([(_ref(group), us)])
            case SetInterleave(group=gid, level=level):
                group = groups.get(gid)
                if group is not None:
                    entries += level_entries([(_ref(group), level)])
            case Preempt(groups=ids):
                entries += preempt_entries(_ref(g) for g in (groups.get(i) for i in ids)
                                           if g is not None)
    return entries


def restore_entries(groups: Iterable[Group], raised: Iterable[Group]) -> list[Sched]:
    """TIMESLICE entries that give each group the driver's default back, then
    INTERLEAVE entries that give the ``raised`` ones the default level."""
    return (timeslice_entries((_ref(g), DEFAULT_TIMESLICE_US) for g in groups)
            + level_entries((_ref(g), LEVEL_MEDIUM) for g in raised))


_OP_NAMES = {SchedState.TIMESLICE: ("SET_TIMESLICE", " us"),
             SchedState.INTERLEAVE: ("SET_INTERLEAVE_LEVEL", "")}


def refusal(entries: Sequence[Sched], results: Sequence[SchedResult | None],
            op: SchedState = SchedState.TIMESLICE) -> str | None:
    """Why the first refused ``op`` entry (TIMESLICE or INTERLEAVE) was refused,
    or None if none was.

    A group that had just gone (ENOENT, an invalid client or object) and a call
    without an answer (the channel) say nothing about the driver: not refusals."""
    name, unit = _OP_NAMES[op]
    for entry, result in zip(entries, results, strict=True):
        if entry.enable != op or result is None:
            continue
        if result.error == -errno.ENOENT or result.status in GONE_STATUSES:
            continue
        if result.error:
            return (f"{name} {entry.arg}{unit} on group {entry.h_object:#x}: "
                    f"errno {-result.error} ({os.strerror(-result.error)})")
        if result.status != NvStatus.OK:
            return (f"{name} {entry.arg}{unit} on group {entry.h_object:#x}: "
                    f"NVIDIA status {result.status:#x}")
    return None
