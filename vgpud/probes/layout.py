"""The names and numbers of ebpf/vgpu_latency.h, for the daemon that reads the
probes' maps (tests/unit/test_probe_layout.py checks them against the header)."""

from __future__ import annotations

LAT_TOTAL = 0
LAT_UPCALL = 1
LAT_DRIVER = 2
LAT_SWITCH = 3
LAT_SLOT = 4
LAT_SLOTS = 65  # buckets of a histogram (struct vgpu_lat_val.slots)

LAT_UVM = 1 << 31
LAT_NR_OTHER = 0x100  # an escape or UVM command above 255 (but UVM_INITIALIZE)
CALL_UPCALL = 0xFFFFFFFF00000000

LAT_STAT_DROPPED = 0
LAT_STAT_N = 1

# Histogram names as D-Bus and the CLI show them, by vgpu_lat_key.hist.
HISTOGRAMS = {LAT_TOTAL: "total", LAT_UPCALL: "upcall", LAT_DRIVER: "driver",
              LAT_SWITCH: "switch", LAT_SLOT: "slot"}


# struct vgpu_lat_key: its fields in order, each a u64.
KEY_FIELDS = ("ctx_id", "hist", "call")


def lat_call(nr: int, key: int) -> int:
    """VGPU_LAT_CALL(nr, key)."""
    return (key & 0xFFFFFFFF) << 32 | (nr & 0xFFFFFFFF)
