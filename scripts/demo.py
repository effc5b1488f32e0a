"""The demo, run as root inside the VM by `make demo` (scripts/vm-run).

nvsim stands in for the NVIDIA driver (2 GPUs of 4 GiB); vgpu exposes
/dev/vgpu/* over it; vgpud enforces two tenants' memory quotas, with its
D-Bus API on a private system bus, and vgpuctl changes a quota live.
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
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "tests"))

from dbus_fixtures import PrivateBus  # noqa: E402
from vgpud_proc import Daemon  # noqa: E402

WORKLOAD = str(ROOT / "tests" / "tenant_workload.py")
CONFIG = """\
[daemon]
state_path = "{state}"

[[tenant]]
name = "team-a"
memory = "1GiB"
match = [{{ uid = 1001 }}]

[[tenant]]
name = "team-b"
memory = "50%"
match = [{{ uid = 1002 }}]
"""


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*cmd: str) -> str:
    print("$ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print(out.rstrip(), flush=True)
    return out


def as_user(uid: int, *args: str | int) -> list[dict]:
    out = run("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
              sys.executable, WORKLOAD, "/dev/vgpu", *map(str, args))
    return [json.loads(line) for line in out.splitlines()]


def main() -> None:
    step("load nvsim (the simulated driver: 2 GPUs x 4 GiB) and vgpu over it")
    run("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=2", "mem_mib=4096")
    run("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim")
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
