"""Every recorded trace under tests/data/traces/ passes the replay check.

The traces are what tests' own client (and, once recorded there, real
programs on a real GPU) sent the driver; a change of vgpud's decoders or
quota policy that no longer agrees with them fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpud.nvtrace.check import check_traces, format_text
from vgpud.nvtrace.fmt import read_trace
from vgpud.nvtrace.nvsim_src import read_nvsim

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
FILES = sorted(TRACES.glob("*.nvtrace.gz"))


def test_there_are_traces() -> None:
    assert len(FILES) >= 4, f"{TRACES}: the recorded traces are missing"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_trace_replays_clean(path: Path) -> None:
    res = check_traces([read_trace(path)], nvsim=read_nvsim())
    assert res.ok, format_text(res)
    assert res.calls > 0 and res.ledger_skipped is None
    (lr,) = res.ledger
    assert lr.held_end == lr.ledger_end and lr.after_close == 0
