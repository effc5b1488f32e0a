"""Item 4: a double fetch outside the shadow rules.

The module matched a call against the filter on its copy of the params, but
forwarded the caller's own pointer when no rule's key matched (and under a
rule without VGPU_RULE_F_SHADOW, and on fail-open): the driver read the
params again. A sibling thread flipping the key in between took the call
past the filter: here hClass between NV50_MEMORY_VIRTUAL (0x50A0, no rule,
not charged) and NV01_MEMORY_LOCAL_USER (0x40, charged), so that the module
saw a virtual range and the driver made video memory nobody charged. Now
every call the module read to match it runs on a shadow of what it read.

The tenant (uid 1003, 64 MiB) races in C (tests/support/attack_flip.c) for
at least 10 s and 10^5 calls, plain and wrapped in IOCTL_XFER_CMD, keeping
whatever it gets. Judged by nvsim: the video memory it holds for the tenant,
sampled during the race, never exceeds the quota.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import attacker_binary, race
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20
QUOTA = 64 * MIB
SIZE = 16 * MIB
RACE_MAX_S = 120


@pytest.fixture(scope="module")
def racer() -> Iterator[Path]:
    with attacker_binary("attack_flip") as exe:
        yield exe




@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "xfer"])
def test_flipping_the_class_gets_no_uncharged_memory(daemon: Daemon, nvsim: Path, racer: Path,
                                                      wrapped: bool) -> None:
    stats, held = race(nvsim, str(racer), str(SIZE), hex(nv.NV50_MEMORY_VIRTUAL),
                       hex(nv.NV01_MEMORY_LOCAL_USER), "10", "120", "100000",
                       *(["xfer"] if wrapped else []), limit=QUOTA // MIB)
    assert stats["attempts"] > 0
    assert max(held) <= QUOTA


@pytest.mark.parametrize("field", ["size", "ptr"])
def test_flipping_the_alloc_params_gets_nothing_unseen(daemon: Daemon, nvsim: Path,
                                                       racer: Path, field: str) -> None:
    """The driver reads alloc params by their class's size and never looks at
    paramsSize (libcuda sends 0), so the module copies them by that size. A
    sibling flipping paramsSize (0 and 0xffffffff) or pAllocParms (to params
    asking for 1 GiB) between the module's copy and the driver's read changes
    nothing: the driver reads the module's copy. Every allocation is the
    16 MiB decided on, whatever paramsSize says; nvsim holds at most the
    quota."""
    stats, held = race(nvsim, str(racer), str(SIZE), hex(nv.NV01_MEMORY_LOCAL_USER),
                       hex(nv.NV01_MEMORY_LOCAL_USER), "10", str(RACE_MAX_S), "100000", field,
                       limit=QUOTA // MIB)
    # The quota holds 4 allocations of 16 MiB, whatever the flipper wrote.
    assert stats["attempts"] > 0 and stats["ok"] == QUOTA // SIZE
    assert max(held) <= QUOTA
    # Each refusal is a log line, bounded to 10 in 10 s (vgpud/lograte.py):
    # the tenant's retries do not flood the daemon's log.
    log = daemon.log()
    refusals = sum("used: refused" in line for line in log.splitlines())
    print(f"{stats['attempts'] - stats['ok']} refusals, {refusals} logged")
    assert refusals <= 10 * (RACE_MAX_S // 10 + 2) and "like it dropped" in log
