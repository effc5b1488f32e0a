"""The metrics adapter on a real socket with its real exporter process:
serving, a taken port, a module that stops answering, an exporter killed,
fed garbage or orphaned; and the quota daemon on the fake kernel with
metrics on."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.aio import until
from tests.support.daemon_world import World, inventory, write_config
from tests.support.fakekernel import make_stats, make_stats4, post_event_msg, upcall_msg
from tests.support.procstat import proc_state
from vgpud.app import build_quota
from vgpud.core.ledger import Usage
from vgpud.daemon import Daemon
from vgpud.host.systemd import Notifier
from vgpud.kernel.channel import ChannelError
from vgpud.kernel.uapi import Stats, Stats4, UpcallKind, VerdictAction
from vgpud.metrics import wire
from vgpud.metrics.exporter import MAX_CLIENTS, NICE, Exporter
from vgpud.metrics.service import MetricsService
from vgpud.metrics.snapshot import Snapshot, collect
from vgpud.nvidia import layouts as L
from vgpud.policy.dispatch import Counters, Dispatcher, VerdictStats

GIB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def values(text: bytes, name: str) -> dict[str, float]:
    """tenant label (or "") -> value of the samples of ``name``."""
    return {s.labels.get("tenant", ""): s.value
            for m in text_string_to_metric_families(text.decode()) for s in m.samples
            if s.name == name}


class Figures:
    """A collect function over a usage the test changes, counting its calls."""

    def __init__(self) -> None:
        self.used = 0
        self.calls = 0

    def __call__(self, module: Stats | None, module4: Stats4 | None) -> Snapshot:
        self.calls += 1
        return collect([Usage("t", 0, GIB, self.used, 0)], uuids={}, denied={},
                       gpu_time_ns=None, target={}, measured={}, counters=Counters(),
                       verdicts=VerdictStats(), overruns=0, module=module, module4=module4)


def test_serves_the_latest_snapshot_from_a_child_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter is a child of ours, serving on the port we bound, without
    systemd's notify socket, at a lower priority (NICE) than ours; stop()
    ends and reaps it and closes the port."""
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/nowhere")
    figures = Figures()
    answers: list[object] = [(make_stats(opens=3), make_stats4()), ChannelError("gone")]

    async def counters() -> tuple[Stats, Stats4 | None]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    async def main() -> None:
        metrics = MetricsService("127.0.0.1", 0, figures, counters, interval=3600)
        assert metrics.start()
        assert metrics.address is not None and metrics.address[1] != 0
        url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
        assert metrics.exporter is not None
        pid = metrics.exporter.pid
        try:
            assert pid != os.getpid() and parent_of(pid) == os.getpid()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [v for v in environ if v.startswith(b"NOTIFY_SOCKET=")]
            want = os.getpriority(os.PRIO_PROCESS, 0) + NICE  # it lowers itself first
            await until(f"nice {want}", lambda: os.getpriority(os.PRIO_PROCESS, pid) == want)
            await asyncio.sleep(0)  # the refresh task's first round
            figures.used = 4096
            status, first = await asyncio.to_thread(get, url)
            assert status == 200
            assert values(first, "vgpud_memory_used_bytes") == {"t": 0}
            assert values(first, "vgpud_module_opens_total") == {"": 3}
            await metrics.refresh()  # GET_STATS fails: the last module figures stay
            status, second = await asyncio.to_thread(get, url)
            assert values(second, "vgpud_memory_used_bytes") == {"t": 4096}
            assert values(second, "vgpud_module_opens_total") == {"": 3}
            assert (await asyncio.to_thread(get, url.replace("/metrics", "/x")))[0] == 404
        finally:
            await metrics.stop()
        assert metrics.exporter is None and metrics.address is None
        assert not Path(f"/proc/{pid}").exists()  # gone and reaped: no zombie either
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])),
                                     timeout=1)

    asyncio.run(asyncio.wait_for(main(), 30))


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


async def module_counters() -> tuple[Stats, Stats4 | None]:
    return make_stats(), None


def test_a_killed_exporter_is_restarted(caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL to the exporter: the daemon logs it, starts another after its
    back-off, and the new one serves the latest snapshot at the same port."""
    figures = Figures()

    async def main() -> None:
        metrics = MetricsService("127.0.0.1", 0, figures, module_counters, interval=3600,
                                 restart_delay=0.2)
        assert metrics.start()
        assert metrics.address is not None and metrics.exporter is not None
        url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
        try:
            assert (await asyncio.to_thread(get, url))[0] == 200
            first = metrics.exporter.pid
            os.kill(first, signal.SIGKILL)
            for _ in range(1000):
                if metrics.exporter is None:
                    break
                await asyncio.sleep(0.01)
            assert metrics.exporter is None  # seen dead, not yet restarted
            assert not Path(f"/proc/{first}").exists()  # reaped
            figures.used = 123
            await metrics.refresh()  # no exporter: kept for the next one
            for _ in range(1000):
                if metrics.exporter is not None:
                    break
                await asyncio.sleep(0.01)
            assert metrics.exporter is not None and metrics.exporter.pid != first
            status, text = await asyncio.to_thread(get, url)
            assert status == 200 and values(text, "vgpud_memory_used_bytes") == {"t": 123}
        finally:
            await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert any("exited with status -9: restarting in 0.2 s" in m for m in caplog.messages)


def test_a_malformed_frame_is_logged_and_the_last_snapshot_kept(
        capfd: pytest.CaptureFixture[str]) -> None:
    """Bytes that are no frame and a frame that is no snapshot: the exporter
    logs both, keeps serving the last good snapshot, and takes the next."""
    figures = Figures()
    figures.used = 7

    async def main() -> None:
        metrics = MetricsService("127.0.0.1", 0, figures, module_counters, interval=3600)
        assert metrics.start()
        assert metrics.address is not None and metrics.exporter is not None
        url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
        pid = metrics.exporter.pid
        try:
            await asyncio.sleep(0)  # the first refresh
            metrics.exporter.offer(b"\xffnot a frame at all")
            metrics.exporter.offer(wire.frame(b"\x00garbage"))
            metrics.exporter.offer(wire.frame(b"[1, 2, 3, 4]"))
            status, text = await asyncio.to_thread(get, url)
            assert status == 200 and values(text, "vgpud_memory_used_bytes") == {"t": 7}
            figures.used = 8
            await metrics.refresh()
            status, text = await asyncio.to_thread(get, url)
            assert status == 200 and values(text, "vgpud_memory_used_bytes") == {"t": 8}
            assert metrics.exporter.pid == pid
        finally:
            await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    err = capfd.readouterr().err
    assert "skipped 19 bytes that were no frame" in err
    assert err.count("dropped a malformed snapshot") == 2


def test_the_exporter_dies_with_the_daemon(tmp_path: Path) -> None:
    """A daemon killed (SIGKILL: no stop()) takes its exporter with it."""
    code = ("import asyncio\n"
            "from vgpud.metrics.service import MetricsService\n"
            "from vgpud.metrics.snapshot import collect\n"
            "from vgpud.policy.dispatch import Counters, VerdictStats\n"
            "def figures(module, module4):\n"
            "    return collect([], uuids={}, denied={}, gpu_time_ns=None, target={},\n"
            "                   measured={}, counters=Counters(), verdicts=VerdictStats(),\n"
            "                   overruns=0, module=module, module4=module4)\n"
            "async def counters():\n"
            "    await asyncio.Event().wait()\n"
            "async def main():\n"
            "    m = MetricsService('127.0.0.1', 0, figures, counters, interval=3600)\n"
            "    assert m.start()\n"
            "    print(m.exporter.pid, flush=True)\n"
            "    await asyncio.sleep(3600)\n"
            "asyncio.run(main())\n")
    daemon = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert daemon.stdout is not None
    pid = int(daemon.stdout.readline())
    daemon.kill()
    daemon.wait()
    deadline = time.monotonic() + 20
    while proc_state(pid) not in ("gone", "Z"):
        assert time.monotonic() < deadline, "the exporter outlived the daemon"
        time.sleep(0.05)


def test_the_daemon_side_loads_no_renderer_nor_http_server() -> None:
    """Rendering and HTTP are the exporter's: the daemon's side (what app.py
    imports) loads neither prometheus_client nor http.server."""
    code = ("import sys, vgpud.metrics.service, vgpud.metrics.sources\n"
            "print(' '.join(sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.split()
    assert [m for m in loaded if m.split(".")[0] in ("prometheus_client", "http")] == []


def test_the_exporter_keeps_the_newest_good_snapshot_and_renders_it_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """In process: frames that queued in the pipe are taken newest first (the
    older ones dropped undecoded); a rendering is reused until a new snapshot."""
    figures = Figures()
    snapshots = []
    for used in (1, 2):
        figures.used = used
        snapshots.append(figures(None, None))
    exporter = Exporter()
    exporter.feed(b"".join(wire.frame(wire.encode(s)) for s in snapshots))
    assert exporter.snapshot == snapshots[1]
    text = exporter.render()
    assert exporter.render() is text
    assert values(text, "vgpud_memory_used_bytes") == {"t": 2}
    exporter.feed(wire.frame(wire.encode(snapshots[0])) + wire.frame(b"\x00bad"))
    assert exporter.snapshot == snapshots[0]
    assert exporter.render() is not text
    assert values(exporter.render(), "vgpud_memory_used_bytes") == {"t": 1}
    assert sum("dropped a malformed snapshot" in m for m in caplog.messages) == 1


def test_a_taken_port_is_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    async def counters() -> tuple[Stats, Stats4 | None]:
        raise AssertionError("not asked: nothing serves")

    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            metrics = MetricsService("127.0.0.1", port, Figures(), counters)
            assert not metrics.start()
            assert metrics.address is None
            await metrics.stop()

    asyncio.run(main())
    assert any("cannot listen on 127.0.0.1 port" in m and "running without metrics" in m
               for m in caplog.messages)


async def serving(timeout: float) -> tuple[MetricsService, int]:
    async def counters() -> tuple[Stats, Stats4 | None]:
        return make_stats(), None

    metrics = MetricsService("127.0.0.1", free_port(), Figures(), counters, interval=3600,
                             request_timeout=timeout)
    assert metrics.start()
    assert metrics.address is not None
    port = metrics.address[1]
    assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics"))[0] == 200
    return metrics, port


def test_slow_clients_hold_up_no_scrape() -> None:
    """A client that sends nothing and one that stops halfway through its
    request, each with 30 s left: a scrape meanwhile is answered at once
    (the exporter waits on no client), and a refresh goes on."""
    async def main() -> None:
        metrics, port = await serving(30.0)
        with socket.create_connection(("127.0.0.1", port)) as silent, \
                socket.create_connection(("127.0.0.1", port)) as halfway:
            halfway.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            await metrics.refresh()
            status, body = await asyncio.wait_for(
                asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics"), 10)
            assert status == 200 and b"vgpud_memory_used_bytes" in body
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open, still waited for
                silent.recv(1)
        await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def trickle(conn: socket.socket, limit: float) -> float:
    """Sends a header a byte every 50 ms until the server closes: how long it took."""
    start = time.monotonic()
    line = b"X-Pad: 1\r\n"
    sent = 0
    while (elapsed := time.monotonic() - start) < limit:
        if select.select([conn], [], [], 0)[0]:
            assert conn.recv(1) == b"", "answered a request that never ended"
            return elapsed
        try:
            conn.send(line[sent % len(line):][:1])
        except OSError:
            return elapsed
        sent += 1
        time.sleep(0.05)
    return limit


def test_a_slow_client_is_cut_at_its_deadline() -> None:
    """A request trickled a byte at a time never ends: the client is cut at
    its deadline (0.5 s), though each byte comes well within it."""
    async def main() -> None:
        metrics, port = await serving(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            took = await asyncio.to_thread(trickle, slow, 20.0)
        assert took < 10, f"still served after {took:.1f} s"
        await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_past_the_cap_the_oldest_client_goes() -> None:
    async def main() -> None:
        metrics, port = await serving(30.0)
        conns = [socket.create_connection(("127.0.0.1", port), timeout=10)
                 for _ in range(MAX_CLIENTS + 1)]
        try:
            assert await asyncio.to_thread(conns[0].recv, 1) == b""
            assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics"))[0] == 200
        finally:
            for conn in conns:
                conn.close()
        await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def mem_alloc(size: int, h_new: int = 0) -> tuple[bytes, bytes]:
    fields = [0] * 23
    fields[13] = size
    alloc = L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*fields)
    return L.NVOS21.struct.pack(1, 2, h_new, 0x40, 0x1000, len(alloc), 0), alloc


def test_quota_daemon_with_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Metrics on in the config: a tenant's 1 GiB, its refused allocation
    (counted from the start, before the server is up) and the verdicts show
    at the configured address; SIGTERM stops the server."""
    caplog.set_level(logging.INFO)
    port = free_port()
    config = write_config(tmp_path, f'\n[metrics]\nenabled = true\nlisten = "127.0.0.1:{port}"\n')
    world = World(tmp_path, stats=make_stats(opens=11))
    policy, app = build_quota(config, "off", inventory, probes=False)
    daemon = Daemon(Dispatcher(policy), policy.filter(), app, open_channel=world.open_channel,
                    notifier=Notifier(world.notify_path))
    url = f"http://127.0.0.1:{port}/metrics"

    async def main() -> None:
        serving = asyncio.create_task(daemon.serve())
        assert (await world.notification()).startswith("READY=1")
        k = world.kernel
        k.send(upcall_msg(kind=UpcallKind.OPEN, id=1, ctx_id=7, uid=1000, cgroup="/"))
        assert (await k.verdicts.get())[:2] == (1, VerdictAction.ALLOW)
        device = L.NV0080_ALLOC_PARAMETERS.struct.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)
        dev_params = L.NVOS21.struct.pack(1, 1, 2, 0x80, 0x1000, len(device), 0)
        k.send(upcall_msg(dev_params, device, id=2, ctx_id=7, nr=0x2B))
        assert (await k.verdicts.get())[:2] == (2, VerdictAction.ALLOW)
        k.send(post_event_msg(7, 2, 0x2B, 0, dev_params, device))
        params, alloc = mem_alloc(GIB)
        k.send(upcall_msg(params, alloc, id=3, ctx_id=7, nr=0x2B))
        assert (await k.verdicts.get())[:2] == (3, VerdictAction.ALLOW)
        k.send(post_event_msg(7, 3, 0x2B, 0, mem_alloc(GIB, h_new=0x99)[0], alloc))
        params, alloc = mem_alloc(4096)
        k.send(upcall_msg(params, alloc, id=4, ctx_id=7, nr=0x2B))
        assert (await k.verdicts.get())[:2] == (4, VerdictAction.FAIL_STATUS)
        for _ in range(500):  # the server starts after READY=1, off the upcall path
            if app.metrics is not None:
                break
            await asyncio.sleep(0.01)
        assert app.metrics is not None
        await app.metrics.refresh()
        status, text = await asyncio.to_thread(get, url)
        assert status == 200
        assert values(text, "vgpud_memory_used_bytes") == {"a": GIB}
        assert values(text, "vgpud_memory_limit_bytes") == {"a": GIB}
        assert values(text, "vgpud_allocations_denied_total") == {"a": 1}
        assert values(text, "vgpud_upcalls_total") == {"": 4}
        assert values(text, "vgpud_module_opens_total") == {"": 11}
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0
        assert app.metrics is None
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)

    asyncio.run(asyncio.wait_for(main(), 20))
    world.close()
    assert any(f"serving http://127.0.0.1:{port}/metrics" in m for m in caplog.messages)
