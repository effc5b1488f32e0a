"""Compile and attach ebpf/vgpu_latency.bpf.c with bcc; read and trim its maps.

Blocking (bcc compiles with clang: seconds, 15-20 s in a TCG guest), so the
probe service calls ``LatencyProbes.load`` in a worker thread. Attach points:
the vgpu tracepoints (required), the backing driver's ioctl handlers by
kprobe (those of BACKING_HANDLERS the kernel has: NVIDIA's on a GPU host,
nvsim's in tests), the vgpu module's SCHEDULE handler by kprobe, and the
driver's pending-work tracepoint where it has one (slot wait). A missing one
only turns its histogram off; each choice is logged.

A BPF program on a module's tracepoint holds a reference to that module (the
perf core pins it), so `modprobe -r vgpu` fails while the probes are
attached: stop the daemon first, which detaches them (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from vgpud.probes.histograms import CountKey
from vgpud.probes.layout import LAT_STAT_DROPPED

__all__ = ["BACKING_HANDLERS", "LatencyProbes", "Probes", "ProbesUnavailable", "find_source",
           "unavailable_reason"]

log = logging.getLogger("vgpud.probes")

TRACEFS = Path("/sys/kernel/tracing")
TRACEPOINTS = ("vgpu:vgpu_ioctl_enter", "vgpu:vgpu_ioctl_exit", "vgpu:vgpu_upcall_send",
               "vgpu:vgpu_upcall_verdict", "vgpu:vgpu_schedule")
# The driver's word on a channel group's pending work, where it says it: only
# nvsim does (a real GPU takes work by doorbell writes the kernel never sees).
PENDING_TRACEPOINT = "nvsim:nvsim_group_work"
# The backing driver's ioctl entry points, in the order tried: the real
# driver's nodes, its UVM node, nvsim (the test driver) for all of them.
BACKING_HANDLERS = ("nvidia_unlocked_ioctl", "uvm_unlocked_ioctl_entry", "nvsim_ioctl")
SCHEDULE_HANDLER = "vgpu_nl_schedule"
# Histograms in the map: 64 tenants x 4 contexts x 16 calls x 4 kinds of
# histogram; an event past it is counted as dropped. Entries are made as
# they are first counted (528 bytes each).
HIST_ENTRIES = 16384
SOURCE = "vgpu_latency.bpf.c"


class ProbesUnavailable(Exception):
    """The probes cannot run here; the message says why, for the log and D-Bus."""


class Probes(Protocol):
    """What ProbeService and the vgpud-probes helper use of loaded probes:
    LatencyProbes in this process, or vgpud.probes.remote.RemoteProbes over the
    helper's socket. ``waiting``: why the probes are off after ``reattach``
    said False. ``maps_made``: the histogram maps made so far (a load makes
    one; a reattach keeps it, unless it had to load again: a lost helper's
    map is gone, and the new one counts from zero)."""

    attach_points: list[str]
    waiting: str
    maps_made: int

    def load(self) -> list[str]: ...
    def stale(self) -> bool: ...
    def reattach(self) -> bool: ...
    def read(self) -> Mapping[CountKey, Sequence[int]]: ...
    def delete(self, keys: Iterable[CountKey]) -> None: ...
    def dropped(self) -> int: ...
    def close(self) -> None: ...


def find_source() -> Path:
    """ebpf/ of this checkout, else the installed copy under <prefix>/share/vgpud/ebpf."""
    for base in (Path(__file__).resolve().parents[2], Path(sys.prefix) / "share/vgpud"):
        path = base / "ebpf" / SOURCE
        if path.is_file():
            return path
    raise ProbesUnavailable(f"{SOURCE} is not installed (looked in the checkout and "
                            f"{sys.prefix}/share/vgpud/ebpf)")


CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def effective_caps(status: Path = Path("/proc/self/status")) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


PERF_PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")


def perf_paranoid(path: Path = PERF_PARANOID) -> int:
    """kernel.perf_event_paranoid (-1 where the kernel has no perf events)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


def unavailable_reason(tracefs: Path = TRACEFS, modules: Path = Path("/lib/modules"),
                       caps: Callable[[], int] = effective_caps,
                       paranoid: Callable[[], int] = perf_paranoid) -> str | None:
    """Why the probes cannot be loaded (None: they can be tried), cheapest check first."""
    have = caps()
    if not (have >> CAP_SYS_ADMIN & 1 or (have >> CAP_BPF & 1 and have >> CAP_PERFMON & 1)):
        return "loading BPF programs needs CAP_BPF and CAP_PERFMON, which this process lacks"
    # Debian's kernels refuse every perf_event_open(2) without CAP_SYS_ADMIN
    # (not CAP_PERFMON) while the sysctl is 3, their default: bcc attaches
    # through perf events.
    if not have >> CAP_SYS_ADMIN & 1 and (level := paranoid()) > 2:
        return (f"kernel.perf_event_paranoid is {level}: attaching needs CAP_SYS_ADMIN, "
                "which this process lacks (or the sysctl at 2)")
    if not (tracefs / "events").is_dir():
        return f"tracefs is not mounted at {tracefs}"
    if not (tracefs / "events/vgpu").is_dir():
        return "the vgpu module's tracepoints are absent (vgpu not loaded)"
    release = os.uname().release
    if not os.environ.get("BCC_KERNEL_SOURCE") and not (modules / release / "build").exists():
        return f"no kernel headers for {release} ({modules / release / 'build'} is missing)"
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        return f"bcc is not importable ({exc}): install python3-bpfcc"
    return None


def _tracepoint_id(name: str) -> int | None:
    """The id of tracepoint "system:event", None while it does not exist."""
    try:
        return int((TRACEFS / "events" / name.replace(":", "/") / "id").read_text())
    except (OSError, ValueError):
        return None


def kprobe_modules(wanted: Iterable[str],
                   path: Path = TRACEFS / "available_filter_functions") -> dict[str, str]:
    """Those of ``wanted`` the kernel can probe now, each with its module ("":
    built in), from tracefs's list of traceable functions ("name [module]").
    Not /proc/kallsyms: vgpud-probes.service's sandbox hides it
    (ProtectKernelTunables=yes)."""
    want = {name.encode() for name in wanted}
    found: dict[str, str] = {}
    try:
        with open(path, "rb") as functions:
            for line in functions:
                fields = line.split()
                if fields and fields[0] in want:
                    module = fields[1].strip(b"[]") if len(fields) > 1 else b""
                    found[fields[0].decode()] = module.decode()
    except OSError as exc:
        log.warning("cannot read %s: %s", path, exc)
    return found


def module_load_id(module: str, sysmodule: Path = Path("/sys/module")) -> int | None:
    """A number that changes each time ``module`` is loaded (the inode of its
    sysfs directory: kernfs never reuses one soon); 0 for the kernel itself
    (""), None while the module is not loaded."""
    if not module:
        return 0
    try:
        return os.stat(sysmodule / module).st_ino
    except OSError:
        return None


def _fn(tracepoint: str) -> str:
    """The function bcc's TRACEPOINT_PROBE(system, event) defines."""
    return "tracepoint__" + tracepoint.replace(":", "__")


class LatencyProbes:
    """The compiled program and what it is attached to."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self._bpf: Any = None
        self._tracepoints: tuple[str, ...] = TRACEPOINTS
        self._tp_ids: dict[str, int | None] = {}
        # role -> (symbol, its module, module_load_id at the attach)
        self._kprobes: dict[str, tuple[str, str, int | None]] = {}
        self.attach_points: list[str] = []
        self.waiting = "waiting for the vgpu tracepoints (module unloaded)"
        self.maps_made = 0

    def load(self) -> list[str]:
        """Compile and attach; the attach points. ProbesUnavailable on failure."""
        try:
            from bcc import BPF
        except ImportError as exc:
            raise ProbesUnavailable(f"bcc is not importable: {exc}") from exc
        cflags = [f"-I{self.source.parent}", f"-DHIST_ENTRIES={HIST_ENTRIES}"]
        self._tracepoints = TRACEPOINTS
        if _tracepoint_id(PENDING_TRACEPOINT) is not None:
            cflags.append("-DVGPU_LAT_NVSIM")
            self._tracepoints += (PENDING_TRACEPOINT,)
        else:
            log.info("no pending-work tracepoint (%s): slot wait is off", PENDING_TRACEPOINT)
        try:
            self._bpf = BPF(src_file=str(self.source).encode(), cflags=cflags)
        except Exception as exc:  # bcc raises bare Exceptions on compile and attach
            raise ProbesUnavailable(f"bcc could not load {self.source.name}: {exc}") from exc
        self._tp_ids = {tp: _tracepoint_id(tp) for tp in self._tracepoints}
        self._attach_kprobes()
        self.attach_points = [f"tracepoint {tp}" for tp in self._tracepoints] + [
            f"kprobe {sym} ({role})" for role, (sym, _, _) in self._kprobes.items()]
        self.maps_made += 1
        return self.attach_points

    def _attach_kprobes(self) -> None:
        self._kprobes = {}
        where = kprobe_modules([*BACKING_HANDLERS, SCHEDULE_HANDLER])
        backing = [s for s in BACKING_HANDLERS if s in where]
        if not backing:
            log.warning("no backing driver handler to probe (%s): driver time is off",
                        ", ".join(BACKING_HANDLERS))
        for i, sym in enumerate(backing):
            self._kprobe(f"driver{i}", sym, where[sym], "driver_enter", "driver_return")
        if SCHEDULE_HANDLER in where:
            self._kprobe("schedule", SCHEDULE_HANDLER, where[SCHEDULE_HANDLER],
                         "schedule_enter", "schedule_return")
        else:
            log.warning("no %s to probe: switch latency is off", SCHEDULE_HANDLER)

    def _kprobe(self, role: str, sym: str, module: str, enter: str, ret: str) -> None:
        self._bpf.attach_kprobe(event=sym, fn_name=enter)
        self._bpf.attach_kretprobe(event=sym, fn_name=ret)
        self._kprobes[role] = (sym, module, module_load_id(module))

    def stale(self) -> bool:
        """The vgpu module or a probed driver was reloaded since the attach."""
        if any(_tracepoint_id(tp) != i for tp, i in self._tp_ids.items()):
            return True
        return any(module_load_id(module) != loaded for _, module, loaded in self._kprobes.values())

    def reattach(self) -> bool:
        """Attach again after a reload; False while the tracepoints are absent."""
        if any(_tracepoint_id(tp) is None for tp in self._tracepoints):
            return False
        self._detach()
        for tp in self._tracepoints:
            self._bpf.attach_tracepoint(tp=tp, fn_name=_fn(tp))
        self._tp_ids = {tp: _tracepoint_id(tp) for tp in self._tracepoints}
        self._attach_kprobes()
        return True

    def _detach(self) -> None:
        for tp in self._tracepoints:
            try:
                self._bpf.detach_tracepoint(tp)
            except Exception:  # not attached (the module went away first)
                log.debug("tracepoint %s was not attached", tp)
        for sym, _, _ in self._kprobes.values():
            for detach in (self._bpf.detach_kprobe, self._bpf.detach_kretprobe):
                try:
                    detach(event=sym)
                except Exception:
                    log.debug("kprobe %s was not attached", sym)
        self._kprobes = {}

    def read(self) -> dict[CountKey, Sequence[int]]:
        """The histogram map: (ctx, hist, call) -> cumulative counts by bucket, then
        the sum of ns. In batches of entries per system call."""
        table = self._bpf["hist"]
        try:
            items = list(table.items_lookup_batch())
        except Exception:  # an old kernel without BPF_MAP_LOOKUP_BATCH on hashes
            items = list(table.items())
        # The u64 fields in order (KEY_FIELDS; slots then sum_ns), at C speed.
        out: dict[CountKey, Sequence[int]] = {}
        for k, v in items:
            ctx, hist, call = memoryview(k).cast("B").cast("Q")
            out[ctx, hist, call] = memoryview(v).cast("B").cast("Q").tolist()
        return out

    def delete(self, keys: Iterable[CountKey]) -> None:
        table = self._bpf["hist"]
        for key in keys:
            with contextlib.suppress(KeyError):
                del table[table.Key(*key)]

    def dropped(self) -> int:
        return int(self._bpf["stats"][ctypes.c_int(LAT_STAT_DROPPED)].value)

    def close(self) -> None:
        """Detach everything and free the maps."""
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
