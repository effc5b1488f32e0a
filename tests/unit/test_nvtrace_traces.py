"""Every recorded trace under tests/data/traces/ passes the replay check.

The traces are what tests' own client (and, once recorded there, real
programs on a real GPU) sent the driver; a change of vgpud's decoders or
quota policy that no longer agrees with them fails here.

A gap a trace shows that is left for a reason is listed in the trace's
``NAME.known`` file beside it: one line per finding, ``TEXT # reason``,
where TEXT is a part of the finding. Every finding must be listed, and
every line must still match a finding (a gap fixed is taken off the list).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.nvtrace.check import check_traces, format_text
from tools.nvtrace.fmt import read_trace
from tools.nvtrace.nvsim_src import read_nvsim

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
FILES = sorted(TRACES.glob("*.nvtrace.gz"))


def known(path: Path) -> list[tuple[str, str]]:
    """(text, reason) of each line of the trace's .known file."""
    listing = path.with_name(path.name.removesuffix(".nvtrace.gz") + ".known")
    if not listing.exists():
        return []
    out = []
    for line in listing.read_text().splitlines():
        text, sep, reason = line.partition(" # ")
        if line.strip() and not line.startswith("#"):
            assert sep and reason.strip(), f"{listing}: {line!r} has no '# reason'"
            out.append((text.strip(), reason.strip()))
    return out


def test_there_are_traces() -> None:
    assert len(FILES) >= 4, f"{TRACES}: the recorded traces are missing"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_trace_replays_clean(path: Path) -> None:
    res = check_traces([read_trace(path)], nvsim=read_nvsim())
    assert res.calls > 0 and res.ledger_skipped is None
    listed = known(path)
    findings = [str(f) for f in res.all_findings]
    unlisted = [f for f in findings if not any(text in f for text, _ in listed)]
    assert not unlisted, format_text(res)
    stale = [text for text, _ in listed if not any(text in f for f in findings)]
    assert not stale, f"listed in {path.name}'s .known but no longer found: {stale}"
    if not listed:
        (lr,) = res.ledger
        assert lr.held_end == lr.ledger_end and lr.after_close == 0
