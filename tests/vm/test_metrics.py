"""Prometheus metrics end to end: nvsim + vgpu + vgpud --config with [metrics]
on, scraped by a real Prometheus server (Debian's /usr/bin/prometheus).

The tenant's memory is asked of Prometheus's HTTP API after known allocations,
and must be the exact byte count; nvsim's own accounting (its heap's free
memory) says the allocations happened, and that the refused one did not.
What Prometheus reads is served by the daemon's one child, the exporter,
which exits by itself when the daemon is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import (
    NVSIM_DIR,
    NVSIM_KO,
    insmod,
    remove_cgroup,
    rmmod,
    wait_path,
)
from tests.support.procstat import proc_state
from tests.support.workloads import CgroupWorkload as Workload

pytestmark = pytest.mark.vm

PROMETHEUS = Path("/usr/bin/prometheus")
CGROOT = Path("/sys/fs/cgroup")
MiB = 1 << 20
# A loaded host's TCG guest starts Prometheus (Go) and the daemon slowly.
START_TIMEOUT_S = 300
SEEN_TIMEOUT_S = 180

CONFIG = """\
[daemon]
state_path = "{state}"
charges_path = "{charges}"

[metrics]
enabled = true
listen = "127.0.0.1:{port}"

[[tenant]]
name = "a"
memory = "512MiB"
match = [{{ cgroup = "/vgpu-metrics-a*" }}]
"""

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: vgpud
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server of our own: its config, a temp TSDB, a loopback port."""

    def __init__(self, workdir: Path, target_port: int) -> None:
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(PROMETHEUS_CONFIG.format(port=target_port))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return bytes(r.read())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log()}"
            try:
                self.get("/-/ready")
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"prometheus not ready in {START_TIMEOUT_S}s:\n{self.log()}")

    def query(self, promql: str) -> list[dict]:
        reply = json.loads(self.get("/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        assert reply["status"] == "success", reply
        return list(reply["data"]["result"])

    def wait_value(self, promql: str, expected: int) -> None:
        """Until ``promql`` gives one sample equal to ``expected``, exactly."""
        deadline = time.monotonic() + SEEN_TIMEOUT_S
        got: list[dict] = []
        while time.monotonic() < deadline:
            got = self.query(promql)
            if len(got) == 1 and got[0]["value"][1] == str(expected):
                return
            time.sleep(0.5)
        raise AssertionError(f"{promql}: {got}, not {expected}; targets: "
                             f"{self.get('/api/v1/targets').decode()[:2000]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def nvsim() -> Iterator[Path]:
    insmod(NVSIM_KO, "gpus=1", "mem_mib=2048")
    wait_path(NVSIM_DIR / "nvidiactl")
    yield NVSIM_DIR
    assert rmmod("nvsim").returncode == 0


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    path = CGROOT / "vgpu-metrics-a"
    path.mkdir(exist_ok=True)
    yield path
    remove_cgroup(path)


@pytest.fixture
def served(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Prometheus]:
    """The quota daemon with metrics on, and Prometheus scraping it every second."""
    if not PROMETHEUS.exists():
        pytest.skip("Debian's prometheus is not installed (scripts/install-deps)")
    port = free_port()
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "run" / "charges", port=port))
    daemon = daemon_factory("--config", str(config), "--no-dbus").start()
    prometheus = Prometheus(tmp_path, port)
    exporters: list[int] = []
    try:
        prometheus.wait_ready()
        exporters = exporter_of(daemon.proc.pid)
        yield prometheus
    finally:
        prometheus.stop()
        daemon.kill()  # SIGKILL: no stop(), the exporter must go by itself
        for pid in exporters:
            wait_gone(pid)
        print(daemon.log())  # shown by pytest when the test fails
        print(prometheus.log())
        shutil.rmtree(tmp_path / "tsdb", ignore_errors=True)


def exporter_of(pid: int) -> list[int]:
    """The daemon's one child, the metrics exporter (started after READY=1)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (found := Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        assert time.monotonic() < deadline, "vgpud started no metrics exporter"
        time.sleep(0.1)
    assert len(found) == 1, found
    return [int(found[0])]


def wait_gone(pid: int, timeout: float = 60) -> None:
    """Until ``pid`` has exited (gone, or a zombie of whoever reaps orphans)."""
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in ("gone", "Z"):
        assert time.monotonic() < deadline, f"the exporter (pid {pid}) outlived the daemon"
        time.sleep(0.1)


def test_prometheus_sees_the_exact_bytes(served: Prometheus, cgroup: Path, nvsim: Path) -> None:
    used = 'vgpud_memory_used_bytes{tenant="a",gpu="0"}'
    denied = 'vgpud_allocations_denied_total{tenant="a",gpu="0"}'
    served.wait_value('vgpud_memory_limit_bytes{tenant="a",gpu="0"}', 512 * MiB)
    served.wait_value(used, 0)
    ctl = nv.NvNodes(str(nvsim)).open_ctl()
    try:
        tree = nv.build_tree(ctl)
        free_before = nv.heap_free_kib(ctl, tree)
        holder = Workload(cgroup, "alloc", "128MiB", "3", "--hold")
        try:
            assert holder.statuses(3) == [0, 0, 0]
            holder.wait_holding()
            assert free_before - nv.heap_free_kib(ctl, tree) == 384 * 1024  # nvsim's truth
            served.wait_value(used, 384 * MiB)
            # Over the limit: refused, nvsim untouched, counted once.
            over = Workload(cgroup, "alloc", "256MiB", "1")
            assert over.statuses(1) == [0x51]
            over.release()
            assert free_before - nv.heap_free_kib(ctl, tree) == 384 * 1024
            served.wait_value(denied, 1)
            served.wait_value(used, 384 * MiB)
        finally:
            holder.release()
        assert nv.heap_free_kib(ctl, tree) == free_before
        served.wait_value(used, 0)
        # The daemon's own counters reach Prometheus too.
        assert served.query("vgpud_upcalls_total")[0]["value"][1] != "0"
        assert served.query('vgpud_verdicts_total{action="fail_status"}')[0]["value"][1] != "0"
        assert served.query("vgpud_module_opens_total")[0]["value"][1] != "0"
    finally:
        os.close(ctl)
