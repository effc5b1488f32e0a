"""Benchmark of the daemon's start: importing its modules, and its RSS then.

Runs ``python -c "import vgpud.daemon"`` RUNS times in fresh interpreters,
for this tree and for each ``--tree`` given (another checkout, imported
through PYTHONPATH), interleaved run by run so that all see the same noise.
Prints, per tree, the p50 and max of the import (``-X importtime``'s
cumulative figure for vgpud.daemon) and the p50 of the process's peak RSS
right after it. In the VM (scripts/vm-run) the same figures are those of a
TCG guest, where each imported file costs far more than on the host.

Prints a table of figures; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import vgpud.daemon, resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
_IMPORT = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| vgpud\.daemon$", re.M)


def one(tree: Path) -> tuple[float, float]:
    """(import ms, peak RSS MiB) of one fresh interpreter importing the daemon."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    m = _IMPORT.search(out.stderr)
    assert m, out.stderr[-2000:]
    return int(m.group(1)) / 1000, int(out.stdout) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another checkout to compare (e.g. a git worktree)")
    args = ap.parse_args()
    trees = [ROOT, *args.tree]
    seen: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    for _ in range(args.runs):
        for tree in trees:
            seen[tree].append(one(tree))
    print(f"{'tree':40} {'import p50 ms':>14} {'max ms':>8} {'RSS p50 MiB':>12}")
    for tree, runs in seen.items():
        ms = [r[0] for r in runs]
        rss = [r[1] for r in runs]
        print(f"{tree!s:40} {statistics.median(ms):14.1f} {max(ms):8.1f} "
              f"{statistics.median(rss):12.1f}")


if __name__ == "__main__":
    main()
