"""Benchmark of the Prometheus metrics (vgpud.metrics); prints figures, asserts nothing.

1. scrape and memory (anywhere): the real daemon (tests/bench/bench_daemon_rss.py's
   --serve: build_quota, the D-Bus service on a private bus, uvloop) on a fake
   kernel, with bench_quota's workload (64 tenants on 8 GPUs, 10,000 live
   allocations), once with [metrics] off and once on. With metrics on, a
   scraper polls every 100 ms for a few seconds: a scrape's time and bytes
   (the slowest are those that render a new snapshot, the rest are served
   from the last rendering), then VmRSS of both daemons and of the metrics
   exporter (the daemon's child that renders and serves).
2. the upcall path under a scraper (--path; in the VM as root, kmod built):
   nvsim + vgpu + vgpud --config (64 tenants, the bench's uid 0) with metrics on; a 1 MiB
   allocation and its free through the quota policy (three upcalls), timed in
   alternating phases: idle, then a scraper (a process of its own) polling
   every 100 ms; p50 and p99 of each (target: within 5%). A third phase is
   the control: the same scraper polling a stand-in server (a process at the
   exporter's nice value, serving as many bytes), which tells what a guest's
   two vCPUs lose to any process that wakes ten times a second from what
   vgpud's metrics cost.

    .venv/bin/python tests/bench/bench_metrics.py [--path [--no-scrape]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from bench_daemon_rss import drive, status  # noqa: E402
from bench_quota import GPUS, TENANTS, Kernel, config_text  # noqa: E402

from tests.support import nvclient as nv  # noqa: E402
from tests.support.bus import PrivateBus  # noqa: E402
from tests.support.fakekernel import FakeKernel  # noqa: E402
from tests.support.vgpud_proc import Daemon  # noqa: E402
from vgpud.metrics.exporter import NICE  # noqa: E402

MiB = 2**20
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics_section(port: int) -> str:
    return f'\n[metrics]\nenabled = true\nlisten = "127.0.0.1:{port}"\n'


class Scraper:
    """GET /metrics every POLL_S in a thread; the time and size of each scrape."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.times_ns: list[int] = []
        self.sizes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter_ns()
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                body = reply.read()
            self.times_ns.append(time.perf_counter_ns() - t0)
            self.sizes.append(len(body))
            self._stop.wait(POLL_S)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def loaded_daemon(tmp: Path, bus: PrivateBus, metrics_port: int | None,
                        scrape_s: float) -> tuple[dict[str, int], Scraper | None]:
    """VmRSS/VmHWM of the daemon at 10,000 live allocations (after the scrapes),
    and the exporter's as exporter_VmRSS/exporter_VmHWM (when metrics are on)."""
    config = tmp / "vgpud.toml"
    config.write_text(config_text(str(tmp / "state.json"), str(tmp / "run" / "charges"))
                      + (metrics_section(metrics_port) if metrics_port else ""))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify"))
    notify.setblocking(False)
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=bus.address, NOTIFY_SOCKET=str(tmp / "notify"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/bench/bench_daemon_rss.py"),
                             "--serve", str(theirs.fileno()), str(config)],
                            pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    kernel = FakeKernel(ours)
    kernel.start()
    loop = asyncio.get_running_loop()
    scraper = None
    try:
        while b"READY=1" not in await asyncio.wait_for(loop.sock_recv(notify, 4096), 600):
            pass
        workload = Kernel(seed=1)
        workload.setup()
        await drive(kernel, workload.take())
        if metrics_port:
            await asyncio.sleep(1.5)  # a snapshot of the loaded daemon
            with Scraper(metrics_port) as scraper:
                await asyncio.sleep(scrape_s)
        figures = status(proc.pid)
        for child in children(proc.pid) if metrics_port else []:
            figures |= {f"exporter_{k}": v for k, v in status(child).items()}
        return figures, scraper
    finally:
        proc.send_signal(signal.SIGTERM)
        await loop.run_in_executor(None, proc.wait)
        kernel.stop()
        notify.close()


def scrape_and_memory(scrape_s: float) -> None:
    bus = PrivateBus()
    try:
        with tempfile.TemporaryDirectory(prefix="vgpud-metrics-") as tmp:
            (Path(tmp) / "off").mkdir()
            (Path(tmp) / "on").mkdir()
            off, _ = asyncio.run(loaded_daemon(Path(tmp) / "off", bus, None, scrape_s))
            on, scraper = asyncio.run(loaded_daemon(Path(tmp) / "on", bus, free_port(),
                                                    scrape_s))
    finally:
        bus.close()
    assert scraper is not None
    times = sorted(scraper.times_ns)
    print(f"{TENANTS} tenants on {GPUS} GPUs ({TENANTS * GPUS} accounts), "
          "10,000 live allocations")
    print(f"  scrape: {len(times)} at {POLL_S * 1000:.0f} ms; "
          f"{statistics.median(scraper.sizes)} bytes; "
          f"p50 {pct(times, .5) / 1e6:.2f} ms, max {times[-1] / 1e6:.2f} ms "
          "(the slowest render a new snapshot)")
    print(f"  VmRSS metrics off {off['VmRSS'] / 1024:.1f} MiB, on {on['VmRSS'] / 1024:.1f} MiB"
          f" (peak {on['VmHWM'] / 1024:.1f}; target < 80)")
    print(f"  exporter process VmRSS {on['exporter_VmRSS'] / 1024:.1f} MiB"
          f" (peak {on['exporter_VmHWM'] / 1024:.1f})\n")


def pct(values: list[int], p: float) -> int:
    return values[min(len(values) - 1, int(len(values) * p))]


class ScraperProcess:
    """The same polling from a process of its own (``--scrape-loop``), so
    that it takes no GIL from the timed loop; the phase starts once it has
    scraped once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.count = 0

    def __enter__(self) -> ScraperProcess:
        self.proc = subprocess.Popen([sys.executable, __file__, "--scrape-loop", str(self.port)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the scraper did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        self.count = int(out.split()[-1])


def scrape_loop(port: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    count = 0
    while not stop.is_set():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            reply.read()
        count += 1
        if count == 1:
            print("ready", flush=True)
        stop.wait(POLL_S)
    print(count)


def static_server(port: int, size: int) -> None:
    """The control's stand-in: ``size`` bytes on every GET, at the exporter's nice."""
    os.nice(NICE)
    body = b"#" * size

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def alloc_free_ns(ctl: int, tree: nv.Tree, count: int) -> list[int]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        r = nv.alloc_memory(ctl, tree.client, tree.device, MiB)
        nv.must(nv.rm_free(ctl, tree.client, tree.device, r.handle), "free")
        out.append(time.perf_counter_ns() - t0)
        nv.must(r, "alloc")
    return out


def wait_serving(port: int, timeout: float = 300) -> None:
    """Until /metrics is served on ``port`` (the daemon starts its metrics after READY=1)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def path_under_scraper(turns: int, count: int) -> None:
    subprocess.run(["insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096"],
                   check=True)
    subprocess.run(["insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
                    "backing_driver=nvsim", "backing_uvm_driver=nvsim"], check=True)
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    config = tmp / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{tmp / "state.json"}"\n'
                      f'charges_path = "{tmp / "charges"}"\n'
                      + "\n[fs]\nenabled = false\n"  # the metrics alone
                      + metrics_section(port)
                      + '\n[[tenant]]\nname = "bench"\nmemory = "1GiB"\nmatch = [{ uid = 0 }]\n'
                      + "".join(f'\n[[tenant]]\nname = "idle-{t}"\nmemory = "64MiB"\n'
                                f"match = [{{ uid = {10_000 + t} }}]\n"
                                for t in range(TENANTS - 1)))
    d = Daemon("--config", str(config), "--no-dbus", log_level="warning").start()
    wait_serving(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        size = len(reply.read())
    static_port = free_port()
    static = subprocess.Popen([sys.executable, __file__, "--static-server", str(static_port),
                               str(size)])
    wait_serving(static_port)
    idle: list[int] = []
    control: list[int] = []
    scraped: list[int] = []
    scrapes = 0
    try:
        ctl = nv.NvNodes("/dev/vgpu").open_ctl()
        try:
            tree = nv.build_tree(ctl)
            alloc_free_ns(ctl, tree, count // 10)  # warm up
            for _ in range(turns):
                idle += alloc_free_ns(ctl, tree, count)
                with ScraperProcess(static_port):
                    control += alloc_free_ns(ctl, tree, count)
                with ScraperProcess(port) as scraper:
                    scraped += alloc_free_ns(ctl, tree, count)
                scrapes += scraper.count
        finally:
            os.close(ctl)
    finally:
        static.terminate()
        static.wait()
        d.stop()
        subprocess.run(["rmmod", "vgpu"], check=False)
        subprocess.run(["rmmod", "nvsim"], check=False)
    idle.sort()
    control.sort()
    scraped.sort()
    print(f"1 MiB alloc + free through vgpud (quota policy, {TENANTS} tenants), "
          f"{turns} x {count} per phase")
    print(f"  idle              p50 {pct(idle, .5):9d} ns  p99 {pct(idle, .99):9d} ns")
    print(f"  control @{POLL_S * 1000:.0f} ms    p50 {pct(control, .5):9d} ns  "
          f"p99 {pct(control, .99):9d} ns  (a stand-in server, {size} bytes)")
    print(f"  scraped @{POLL_S * 1000:.0f} ms    p50 {pct(scraped, .5):9d} ns  "
          f"p99 {pct(scraped, .99):9d} ns  ({scrapes} scrapes)")
    print(f"  ratio to idle     p50 {pct(scraped, .5) / pct(idle, .5):.3f}  "
          f"p99 {pct(scraped, .99) / pct(idle, .99):.3f}  (target <= 1.05)")
    print(f"  ratio to control  p50 {pct(scraped, .5) / pct(control, .5):.3f}  "
          f"p99 {pct(scraped, .99) / pct(control, .99):.3f}\n")


def main() -> None:
    if sys.argv[1:2] == ["--scrape-loop"]:
        scrape_loop(int(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--static-server"]:
        static_server(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", action="store_true",
                    help="also the upcall path under a scraper (VM: loads nvsim and vgpu)")
    ap.add_argument("--no-scrape", action="store_true",
                    help="skip 1 (minutes in a TCG guest: two daemons take 10,000 allocations)")
    ap.add_argument("--scrape-s", type=float, default=5.0)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--allocs", type=int, default=300, help="alloc/free pairs per phase")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # figures as they come
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs\n")
    if not args.no_scrape:
        scrape_and_memory(args.scrape_s)
    if args.path:
        path_under_scraper(args.turns, args.allocs)


if __name__ == "__main__":
    main()
