"""Channel-group scheduling as the VM tests see it: LIST_CONTEXTS and SCHEDULE
through vgpud's own GenlChannel, the module's vgpu_schedule tracepoint (the
`sched_trace` fixture of tests/vm/conftest.py enables it), and nvsim's own
view of a group (/proc/driver/nvsim/groups).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from vgpud.kernel.channel import GenlChannel
from vgpud.kernel.uapi import Context, Sched, SchedResult

TRACEFS = Path("/sys/kernel/tracing")
GROUPS = Path("/proc/driver/nvsim/groups")


def aio(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def list_contexts() -> list[Context]:
    channel = await GenlChannel.open()
    try:
        return await channel.list_contexts()
    finally:
        channel.close()


async def schedule(entries: list[Sched]) -> list[SchedResult]:
    """SCHEDULE as the registered daemon (unregistered when the socket closes)."""
    channel = await GenlChannel.open()
    try:
        await channel.register()
        return await channel.schedule(entries)
    finally:
        channel.close()


def traced(trace: Path) -> list[dict[str, str]]:
    """The vgpu_schedule events recorded so far, oldest first."""
    out = []
    for line in trace.read_text().splitlines():
        if "vgpu_schedule:" in line:
            tail = line.split("vgpu_schedule:", 1)[1]
            out.append(dict(w.split("=", 1) for w in tail.split()))
    return out


def group_enabled(client: int, group: int) -> bool | None:
    """nvsim's enabled flag of a channel group, where nvsim shows it (else None)."""
    if not GROUPS.exists():
        return None
    lines = GROUPS.read_text().splitlines()
    head = lines[0].split()
    for line in lines[1:]:
        row = dict(zip(head, line.split(), strict=True))
        if int(row["client"], 16) == client and int(row["group"], 16) == group:
            return row["enabled"] not in ("0", "n", "no", "false")
    raise AssertionError(f"group {client:#x}/{group:#x} not in {GROUPS}")
