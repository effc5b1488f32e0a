"""Saturating GPU tenants for the TDMA VM tests and benchmark (nvsim's work engine).

    python -m tests.support.tdma_workload NODEDIR --cgroup PATH [--cgroup PATH ...]
                                          [--gpu N] [--target-ms 40] [--period-ms 10]

(from the repository root; `command()` gives that argv, to run with cwd=ROOT).

For each --cgroup (a cgroup v2 directory, one per tenant) the process moves
itself into it, opens NODEDIR/nvidiactl (the module records the opener's
cgroup then, so each file belongs to that cgroup's tenant), builds a client /
device / subdevice tree on GPU N and allocates a channel group; then it moves
back. It prints one JSON line, {"tenants": [{"cgroup", "client", "group"}]},
and from then on keeps each tenant's pending work at --target-ms or more
(NVSIM_ESC_SUBMIT_WORK, checked against /proc/driver/nvsim/groups every
--period-ms), so a tenant switched off never drains and one switched on
never runs dry. Commands on stdin, one per line: "idle I" stops topping up
tenant I (its pending work drains when it runs), "busy I" resumes; EOF quits.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from pathlib import Path

from tests.support import nvclient as nv

MS = 1_000_000


def command(*args: str) -> list[str]:
    """The argv that runs this workload; run it with the repository root as cwd."""
    return [sys.executable, "-m", "tests.support.tdma_workload", *args]


def move_to(cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nodedir")
    ap.add_argument("--cgroup", action="append", type=Path, required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--period-ms", type=float, default=10.0)
    args = ap.parse_args()

    home = Path("/sys/fs/cgroup") / Path(
        Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]).relative_to("/")
    nodes = nv.NvNodes(args.nodedir)
    tenants = []  # (ctl fd, client, group)
    for cgroup in args.cgroup:
        move_to(cgroup)
        ctl = nodes.open_ctl()
        tree = nv.build_tree(ctl, device_id=args.gpu)
        group = nv.alloc_channel_group(ctl, tree.client, tree.device)
        tenants.append((ctl, tree.client, group))
    move_to(home)
    print(json.dumps({"tenants": [{"cgroup": str(c), "client": client, "group": group}
                                  for c, (_, client, group) in zip(args.cgroup, tenants,
                                                                   strict=True)]}),
          flush=True)

    target = int(args.target_ms * MS)
    busy = [True] * len(tenants)
    index = {(client, group): i for i, (_, client, group) in enumerate(tenants)}
    period = args.period_ms / 1000
    pending = b""  # commands read, not yet whole lines
    while True:
        # os.read, not sys.stdin: lines Python buffered would not wake select.
        ready, _, _ = select.select([0], [], [], period)
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                what, _, which = line.decode().partition(" ")
                busy[int(which)] = what == "busy"
        for g in nv.proc_groups():
            i = index.get((g.client, g.group))
            if i is not None and busy[i] and g.pending_ns < target:
                ctl, client, group = tenants[i]
                e, st = nv.submit_work(ctl, client, group, target - g.pending_ns + target)
                if e or st:
                    print(json.dumps({"tenant": i, "errno": e, "status": st}), flush=True)
    for ctl, _, _ in tenants:
        os.close(ctl)


if __name__ == "__main__":
    main()
