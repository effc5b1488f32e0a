"""The demo, run as root inside the VM by `make demo` (scripts/vm-run).

nvsim stands in for the NVIDIA driver (2 GPUs of 4 GiB); vgpu exposes
/dev/vgpu/* over it; vgpud enforces two tenants' memory quotas, with its
D-Bus API on a private system bus, and vgpuctl changes a quota live; then
the two share GPU 0's time by weight (runlist mode: each channel group's
timeslice), and vgpuctl changes a weight live.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402
from tests.support import tenant_workload  # noqa: E402
from tests.support.bus import PrivateBus  # noqa: E402
from tests.support.vgpud_proc import Daemon  # noqa: E402

CONFIG = """\
[daemon]
state_path = "{state}"

[[tenant]]
name = "team-a"
memory = "1GiB"
weight = 300
match = [{{ uid = 1001 }}]

[[tenant]]
name = "team-b"
memory = "50%"
weight = 100
match = [{{ uid = 1002 }}]
"""


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*cmd: str) -> str:
    print("$ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    print(out.rstrip(), flush=True)
    return out


def user_argv(uid: int, *args: str | float) -> list[str]:
    """tests/support/tenant_workload.py as user `uid` (to run with cwd=ROOT)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            *tenant_workload.command("/dev/vgpu", *map(str, args))]


def as_user(uid: int, *args: str | int) -> list[dict]:
    out = run(*user_argv(uid, *args))
    return [json.loads(line) for line in out.splitlines()]


def planned_groups(procs: list[subprocess.Popen[str]], made: list[dict]) -> list[tuple[int, int]]:
    """Runlist mode (the default): each new group came back off
    (VERDICT_F_SCHED_OFF) and is switched on only once the scheduler has given
    it its tenant's timeslice; nvsim's own group table shows both on. Returns
    the groups as (tgid, handle), team-a's first."""
    keys = [(proc.pid, m["group"]) for proc, m in zip(procs, made, strict=True)]
    deadline = time.monotonic() + 30  # a loaded TCG guest: seconds, not ms
    while True:
        rows = {(g.tgid, g.group): g for g in nv.proc_groups()}
        if all(k in rows and rows[k].enabled for k in keys):
            break
        assert time.monotonic() < deadline, f"groups not all switched on: {rows}"
        time.sleep(0.1)
    for name, key in zip(("team-a", "team-b"), keys, strict=True):
        print(f"nvsim: {name}'s group {key[1]:#x} on, timeslice {rows[key].timeslice_us} us",
              flush=True)
    return keys


def busy_ns(keys: list[tuple[int, int]]) -> list[int]:
    """The groups' busy time as nvsim counts it."""
    rows = {(g.tgid, g.group): g for g in nv.proc_groups()}
    return [rows[k].busy_ns for k in keys]


def compute_shares(settle: float, window: float) -> list[float]:
    """team-a and team-b each saturate a channel group on GPU 0: their busy
    shares (%) over `window` seconds, once the scheduler's feedback has had
    `settle` seconds (a slow guest's timer overruns shrink the ratio of the
    slices until it corrects them)."""
    argvs = [user_argv(uid, "compute", settle + window + 2) for uid in (1001, 1002)]
    for argv in argvs:
        print("$ " + " ".join(argv) + " &", flush=True)
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT) for argv in argvs]
    made = []
    for proc in procs:
        assert proc.stdout is not None
        made.append(json.loads(proc.stdout.readline()))
        print(made[-1], flush=True)
    keys = planned_groups(procs, made)
    time.sleep(settle)
    before = busy_ns(keys)
    time.sleep(window)
    busy = [b - a for a, b in zip(before, busy_ns(keys), strict=True)]
    for proc in procs:
        proc.communicate(timeout=settle + window + 60)
    shares = [round(100 * b / sum(busy), 1) for b in busy]
    print(f"measured busy shares over {window:.0f} s: team-a {shares[0]}%, team-b {shares[1]}%",
          flush=True)
    return shares


def main() -> None:
    step("load nvsim (the simulated driver: 2 GPUs x 4 GiB) and vgpu over it")
    run("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=2", "mem_mib=4096")
    run("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
        "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    time.sleep(0.2)
    run("ls", "-l", "/dev/vgpu")

    step("start vgpud: team-a (uid 1001) 1 GiB, team-b (uid 1002) 50%, D-Bus on a private bus")
    work = Path(tempfile.mkdtemp(prefix="vgpud-demo-"))
    config = work / "vgpud.toml"
    config.write_text(CONFIG.format(state=work / "state.json"))
    print(config.read_text())
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address  # for vgpud and vgpuctl
    daemon = Daemon("--config", str(config), log_level="info", echo=True).start()
    try:
        run("vgpuctl", "status")

        step("team-a allocates 256 MiB blocks: the fifth is an ordinary out-of-memory (0x51)")
        results = as_user(1001, "alloc", "256MiB", 5)
        assert [r["status"] for r in results] == [0, 0, 0, 0, 0x51], results

        step("team-a sees its budget as the whole GPU (FB_GET_INFO_V2, KiB)")
        view = as_user(1001, "fbinfo")[0]
        assert view["total_ram_size"] == 1 << 20, view

        step("team-b (50% of 4 GiB) is not affected")
        results = as_user(1002, "alloc", "512MiB", 3)
        assert all(r["status"] == 0 for r in results), results

        step("uid 1003 matches no tenant and there is no default: its open is refused")
        print(as_user(1003, "alloc", "1MiB", 1))

        step("raise team-a's quota live, over D-Bus")
        run("vgpuctl", "tenant", "set", "team-a", "--memory", "2GiB")
        results = as_user(1001, "alloc", "256MiB", 5)
        assert all(r["status"] == 0 for r in results), results
        run("vgpuctl", "tenant", "list")

        step("time slices: team-a (weight 300) and team-b (weight 100) saturate GPU 0;"
             " each new channel group is switched on once it has its tenant's timeslice")
        shares = compute_shares(3.0, 4.0)
        assert abs(shares[0] - 75) <= 5, shares

        step("give team-b the same weight, live: the next frame splits GPU 0 evenly")
        run("vgpuctl", "tenant", "set", "team-b", "--weight", "300")
        shares = compute_shares(3.0, 4.0)
        assert abs(shares[0] - 50) <= 5, shares
        run("vgpuctl", "module-stats")
    finally:
        daemon.stop()
        bus.close()
    step("stop vgpud and unload the modules")
    run("rmmod", "vgpu")
    run("rmmod", "nvsim")
    print("\ndemo: ok", flush=True)


if __name__ == "__main__":
    main()
