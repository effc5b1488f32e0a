"""The replay check: recorded traces through vgpud's decoders and quota policy.

It fails (``CheckResult.ok`` is False) when
- a call the driver completed does not decode, or was not recorded whole;
- a memory allocation's size as vgpud charges it (the size asked, rounded up
  to the page) is not the size the driver wrote back (rounded the same way);
- the ledger, fed the trace as the vgpu module would feed it, ever charges
  other than the memory the trace holds (model.HeldMemory), or the quota
  policy refuses a call the driver completed;
- a trace is malformed.
It lists, without failing, calls vgpud does not decode (unknown escapes,
classes and controls), and reports every escape, class, control and UVM
command seen, with counts, marked where vgpud or nvsim does not handle it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.nvtrace.calls import Ioctl, NodeKind, events
from tools.nvtrace.fmt import Block, Meta, Trace
from tools.nvtrace.ledger import LedgerResult, PolicyReplay
from tools.nvtrace.nvsim_src import NvsimModel
from tools.nvtrace.report import Finding, Row, format_rows, inventory_keys, row_name
from tools.nvtrace.vgpud_api import QuotaStackMissing, quota_stack
from vgpud.nvidia.escapes import DEVICE_MEMORY_CLASSES, NVOS32_ALLOC_FLAGS_VIRTUAL, VidHeapFunction
from vgpud.nvidia.layouts import (
    Call,
    DecodeError,
    MemoryAllocParams,
    RmAlloc,
    RmAllocMemory,
    RmControl,
    VidHeapControl,
    decode_call,
)
from vgpud.nvidia.pages import PAGE_SIZE, granule, page_round

__all__ = ["Allocation", "CheckResult", "check_traces"]

# The replay's inventory: GPUs 0-15 of 1 PiB (the trace, not the ledger, limits).
REPLAY_GPUS = [(i, "replay", 1 << 50) for i in range(16)]


@dataclass(frozen=True, slots=True)
class Allocation:
    trace: str
    seq: int
    what: str  # escape and class
    asked: int
    returned: int
    granule: int = PAGE_SIZE  # what the policy rounds the size asked up to

    @property
    def charged(self) -> int:
        return page_round(self.asked, self.granule)

    @property
    def matches(self) -> bool:
        return self.charged == page_round(self.returned)


@dataclass(slots=True)
class CheckResult:
    traces: list[Trace]
    calls: int = 0  # ioctls on the ctl and GPU nodes' NVIDIA escapes
    decoded: int = 0
    unknown: Counter[str] = field(default_factory=Counter)  # "ESCAPE class X" -> calls
    allocations: list[Allocation] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rows: dict[tuple[str, int], Row] = field(default_factory=dict)
    ledger: list[LedgerResult] = field(default_factory=list)
    ledger_skipped: str | None = None
    nvsim: NvsimModel | None = None

    @property
    def all_findings(self) -> list[Finding]:
        return self.findings + [f for res in self.ledger for f in res.findings]

    @property
    def ok(self) -> bool:
        return not self.all_findings

    def row(self, key: tuple[str, int]) -> Row:
        if key not in self.rows:
            self.rows[key] = Row(*key)
        return self.rows[key]


def check_traces(traces: list[Trace], *, nvsim: NvsimModel | None = None,
                 ledger: bool = True) -> CheckResult:
    """Check every trace; ``ledger=False`` skips the quota policy replay."""
    res = CheckResult(traces, nvsim=nvsim)
    for trace in traces:
        if trace.tail:
            res.findings.append(Finding(trace.name, -1, f"{trace.tail} bytes of an incomplete "
                                        "last record (the process died while writing it)"))
        for ev in events(trace):
            if isinstance(ev, Ioctl):
                _call(res, trace, ev)
    if not ledger:
        res.ledger_skipped = "not asked for"
        return res
    try:
        replay = PolicyReplay(quota_stack(REPLAY_GPUS))
    except QuotaStackMissing as exc:
        res.ledger_skipped = f"vgpud's quota stack cannot be imported here ({exc})"
        return res
    for trace in traces:
        lr = replay.run(trace)
        res.ledger.append(lr)
        for key, n in lr.up.items():
            res.row(key).up += n
    return res


def _call(res: CheckResult, trace: Trace, ev: Ioctl) -> None:
    keys = inventory_keys(ev, ev.params_in)
    for key in keys:
        row = res.row(key)
        row.calls += 1
        if not ev.ok:
            row.failed += 1
            if ev.status:
                row.statuses[ev.status] += 1
    if ev.node.kind in (NodeKind.CTL, NodeKind.GPU) and ev.nvidia:
        res.calls += 1
        _decode(res, trace, ev, res.row(keys[0]))


def _find(res: CheckResult, trace: Trace, ev: Ioctl, what: str) -> None:
    res.findings.append(Finding(trace.name, ev.seq, f"escape {ev.nr:#x}"
                                f"{' (XFER)' if ev.xfer else ''}: {what}"))


def _whole(block: Block | None) -> bytes | None:
    return block.data if block is not None and block.whole else None


def _decode(res: CheckResult, trace: Trace, ev: Ioctl, row: Row) -> None:
    name = row_name("escape", ev.nr)
    if ev.params_in is None or ev.params_out is None:
        if ev.ok:
            _find(res, trace, ev, "params not recorded whole (unreadable or cut)")
        else:
            res.unknown[f"{name} ({ev.nr:#x}) params unreadable, call failed"] += 1
        return
    try:
        call_in = decode_call(ev.nr, ev.params_in, _whole(ev.data_in))
        call_out = decode_call(ev.nr, ev.params_out, _whole(ev.data_out))
    except DecodeError as exc:
        if ev.ok:
            _find(res, trace, ev, f"does not decode: {exc}")
        else:
            res.unknown[f"{name} ({ev.nr:#x}) not decoded, rejected by the driver"] += 1
        return
    if call_in is None:
        res.unknown[f"{name} ({ev.nr:#x})"] += 1
        return
    res.decoded += 1
    row.decoded = True
    if isinstance(call_in, RmAlloc) and row_name("class", call_in.h_class) == "?":
        res.unknown[f"RM_ALLOC class {call_in.h_class:#x}"] += 1
    elif isinstance(call_in, RmControl) and row_name("control", call_in.cmd) == "?":
        res.unknown[f"RM_CONTROL control {call_in.cmd:#x}"] += 1
    if ev.ok:
        _size(res, trace, ev, call_in, call_out)


def _asked_returned(call_in: Call, call_out: Call | None) -> tuple[str, int, int, int] | None:
    """A memory allocation's size asked, size returned and the granule the
    policy rounds it up to; None for other calls."""
    if isinstance(call_in, RmAlloc) and call_in.h_class in DEVICE_MEMORY_CLASSES:
        a_in = call_in.alloc
        a_out = call_out.alloc if isinstance(call_out, RmAlloc) else None
        if isinstance(a_in, MemoryAllocParams):
            got = a_out.size if isinstance(a_out, MemoryAllocParams) else -1
            return (f"RM_ALLOC class {call_in.h_class:#x}", a_in.size, got,
                    granule(a_in.attr, a_in.attr2, a_in.alignment))
        return f"RM_ALLOC class {call_in.h_class:#x} (alloc params not recorded)", -1, -1, 1
    if isinstance(call_in, RmAllocMemory) and call_in.h_class in DEVICE_MEMORY_CLASSES:
        got = call_out.limit + 1 if isinstance(call_out, RmAllocMemory) else -1
        return f"RM_ALLOC_MEMORY class {call_in.h_class:#x}", call_in.limit + 1, got, PAGE_SIZE
    if (isinstance(call_in, VidHeapControl) and call_in.function == VidHeapFunction.ALLOC_SIZE
            and call_in.alloc is not None
            and not call_in.alloc.flags & NVOS32_ALLOC_FLAGS_VIRTUAL):
        a, out = call_in.alloc, call_out.alloc if isinstance(call_out, VidHeapControl) else None
        return ("RM_VID_HEAP_CONTROL ALLOC_SIZE", a.size, out.size if out else -1,
                granule(a.attr, a.attr2, a.alignment))
    return None


def _size(res: CheckResult, trace: Trace, ev: Ioctl, call_in: Call,
          call_out: Call | None) -> None:
    found = _asked_returned(call_in, call_out)
    if found is None:
        return
    what, asked, returned, rounding = found
    alloc = Allocation(trace.name, ev.seq, what, asked, returned, rounding)
    res.allocations.append(alloc)
    if asked < 0 or returned < 0:
        _find(res, trace, ev, f"{what}: size not recorded")
    elif not alloc.matches:
        _find(res, trace, ev, f"{what}: vgpud charges {alloc.charged} bytes (asked "
              f"{asked}), the driver returned {returned}")


# --- text and JSON ------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n} B ({n / (1 << 30):.3f} GiB)"


def _trace_lines(res: CheckResult) -> list[str]:
    lines = []
    for t in res.traces:
        h = t.header
        gpus = ", ".join(h.values(Meta.GPU)) or "-"
        lines.append(f"  {t.name}: pid {h.pid} {h.value(Meta.COMM) or '?'}, "
                     f"{len(t.records)} records; driver {h.value(Meta.DRIVER) or '-'}; "
                     f"GPU {gpus}")
    return lines


def _ledger_lines(res: CheckResult) -> list[str]:
    if res.ledger_skipped:
        return [f"ledger: skipped: {res.ledger_skipped}"]
    lines = ["ledger (quota policy fed as the vgpu module would feed it):"]
    for lr in res.ledger:
        lines.append(f"  {lr.trace}: {lr.calls_up} upcalls, {lr.replies} rewritten views; "
                     f"at the end the trace holds {_gib(lr.held_end)}, the ledger charges "
                     f"{_gib(lr.ledger_end)}; {lr.divergences} divergences; "
                     f"{lr.after_close} B after close")
    return lines


def format_text(res: CheckResult) -> str:
    mismatched = sum(1 for a in res.allocations if not a.matches)
    lines = [f"nvtrace check: {len(res.traces)} traces, {res.calls} RM/OS calls, "
             f"{res.decoded} decoded, {sum(res.unknown.values())} not decoded (listed)",
             *_trace_lines(res),
             f"memory allocations: {len(res.allocations)}, {mismatched} with a size vgpud "
             "would charge differently",
             *_ledger_lines(res)]
    findings = res.all_findings
    lines.append(f"findings: {len(findings)}" + ("" if findings else " (check passed)"))
    lines += [f"  {f}" for f in findings[:50]]
    if len(findings) > 50:
        lines.append(f"  ... {len(findings) - 50} more")
    if res.unknown:
        lines.append("not decoded by vgpud (listed, not failures):")
        lines += [f"  {what}: {n}" for what, n in sorted(res.unknown.items())]
    lines.append("inventory (vgpud: decoded or named by vgpud.nvidia; nvsim: modelled by "
                 "kmod/nvsim; up: sent to the daemon by the quota filter):")
    lines += format_rows(list(res.rows.values()), res.nvsim)
    return "\n".join(lines) + "\n"


def to_json(res: CheckResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "traces": [{"name": t.name, "pid": t.header.pid, "records": len(t.records),
                    "meta": [[tag, v] for tag, v in t.header.meta]} for t in res.traces],
        "calls": res.calls, "decoded": res.decoded, "unknown": dict(res.unknown),
        "allocations": [[a.trace, a.seq, a.what, a.asked, a.returned] for a in res.allocations],
        "findings": [str(f) for f in res.all_findings],
        "ledger": None if res.ledger_skipped else [
            {"trace": lr.trace, "held_end": lr.held_end, "ledger_end": lr.ledger_end,
             "after_close": lr.after_close, "upcalls": lr.calls_up,
             "divergences": lr.divergences} for lr in res.ledger],
        "ledger_skipped": res.ledger_skipped,
        "rows": [{"kind": r.kind, "key": r.key, "name": row_name(r.kind, r.key),
                  "calls": r.calls, "failed": r.failed, "up": r.up,
                  "statuses": {f"{s:#x}": n for s, n in r.statuses.items()}}
                 for r in res.rows.values()],
    }


def write_json(res: CheckResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(res), indent=1) + "\n")
