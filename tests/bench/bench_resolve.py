"""Tenant resolution at open with N bound cgroups (BindCgroup), as the
quota policy runs it: the Manager's bindings and its stat of a bound path
that an opener is below (a tmpfs tree stands in for cgroupfs here).

    .venv/bin/python tests/bench/bench_resolve.py [--opens N]

Prints microseconds per resolution for openers outside every bound cgroup,
in a bound cgroup, and below one (the case that stats the bound path).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from vgpud.admin.manager import Manager
from vgpud.core.ledger import Ledger
from vgpud.core.tenants import Opener, resolve
from vgpud.store.config import parse_config
from vgpud.store.state import CgroupPathBinding, RuntimeState

CONFIG = """\
[daemon]
default_tenant = "shared"
state_path = "{state}"

[[tenant]]
name = "ctr"

[[tenant]]
name = "shared"
match = [{{ uid = 1000 }}]
"""


def manager(root: Path, top: Path, n: int) -> Manager:
    bound = {}
    for i in range(n):
        path = root / "machine.slice" / f"libpod-{i}.scope"
        (path / "sub").mkdir(parents=True)
        bound[f"/machine.slice/libpod-{i}.scope"] = CgroupPathBinding(
            tenant="ctr", cgroup_id=path.stat().st_ino, boot_id="b")
    config = parse_config(CONFIG.format(state=top / "state.json"))
    return Manager(top / "vgpud.toml", config, RuntimeState(cgroup_bindings=bound), Ledger(),
                   (), process_start=lambda pid: None, boot_id="b", cgroup_root=root)


def per_open(m: Manager, opener: Opener, opens: int) -> float:
    start = time.perf_counter()
    for _ in range(opens):
        resolve(opener, m.tenants, m.bindings, m.default_tenant, m.cgroup_bindings,
                m.cgroup_id_of)
    return (time.perf_counter() - start) / opens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opens", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print("bound cgroups | outside us | in the bound cgroup us | below it us")
        for n in (1, 100, 10_000):
            root = Path(d) / f"cgroup-{n}"
            m = manager(root, Path(d), n)
            last = f"/machine.slice/libpod-{n - 1}.scope"
            ino = (root / last.lstrip("/")).stat().st_ino
            cases = (Opener(1, 1, 1000, 1000, 2, "/user.slice/session-1.scope", 1),
                     Opener(1, 1, 1000, 1000, ino, last, 1),
                     Opener(1, 1, 1000, 1000, 3, f"{last}/sub", 1))
            times = [per_open(m, o, args.opens) for o in cases]
            print(f"{n} | " + " | ".join(f"{t:.1f}" for t in times))


if __name__ == "__main__":
    main()
