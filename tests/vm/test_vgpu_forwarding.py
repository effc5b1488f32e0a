"""kmod/vgpu forwarding what no rule filters (VM tier): its nodes, the fast path
of ioctls and mmaps to the backing driver, fd translation, its counters, and
unloading it (refused while a file is open, also with a caller killed in an
upcall). nvsim is the backing driver (the `vg` fixture of conftest.py).

    scripts/test-vm -k test_vgpu_forwarding
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.calls import (
    CHECK_VERSION_STR,
    NVOS21,
    REGISTER_FD,
    RM_ALLOC,
    alloc,
    ioctl,
    iowr,
    status_of,
)
from tests.support.guest import ROOT, VGPU_DIR, Env, insmod, loaded, rmmod, wait_for, wait_path
from tests.support.responder import start
from tests.support.vgpu_genl import ALLOW, NODE_CTL, PROTO_VERSION, Genl, NlError, rule, stats

pytestmark = pytest.mark.vm


def test_nodes_appear(vg: Env) -> None:
    ctl = os.stat(vg.dev / "nvidiactl")
    assert (ctl.st_mode & 0o7777) == 0o666
    assert os.major(ctl.st_rdev) != os.major(os.stat(vg.backing / "nvidiactl").st_rdev)
    gpus = sorted(p.name for p in vg.backing.glob("nvidia[0-9]*"))
    assert sorted(p.name for p in vg.dev.glob("nvidia[0-9]*")) == gpus
    assert (vg.dev / "nvidia-uvm").exists() == (vg.backing / "nvidia-uvm").exists()


def test_fast_path_forwards(vg: Env) -> None:
    before = stats()
    fd = vg.open()
    try:
        buf = ctypes.create_string_buffer(struct.pack("=II64s", ord("2"), 0, b""))
        if vg.nvsim:
            assert ioctl(fd, iowr(CHECK_VERSION_STR, 72), buf) == 0
            assert buf.raw[8:17] == b"595.45.04"
            ret, params = alloc(fd, 0x41, xfer=True)
            assert ret == 0 and status_of(params) == 0
        else:
            with pytest.raises(OSError):
                ioctl(fd, iowr(CHECK_VERSION_STR, 72), buf)
    finally:
        os.close(fd)
    after = stats()
    assert after["ioctls"] >= before["ioctls"] + 2
    assert after["opens"] == before["opens"] + 1
    assert after["upcalls"] == before["upcalls"]


def test_mmap_forwards(vg: Env) -> None:
    name = "nvidia0" if (vg.dev / "nvidia0").exists() else "nvidiactl"
    fd = vg.open(name)
    before = stats()["mmaps"]
    try:
        try:
            m = mmap.mmap(fd, 4096)
            m.close()
            forwarded = True
        except OSError as e:
            forwarded = e.errno != errno.ENODEV
    finally:
        os.close(fd)
    assert stats()["mmaps"] == before + (1 if forwarded else 0)


def test_fd_translation(vg: Env, responder_bin: Path, responders) -> None:
    if not vg.nvsim:
        pytest.skip("needs nvsim, which checks fds")
    ctl, gpu = vg.open(), vg.open("nvidia0")
    other = os.open("/dev/null", os.O_RDWR)
    try:
        nfds = len(os.listdir("/proc/self/fd"))
        buf = ctypes.create_string_buffer(struct.pack("=i", other))
        with pytest.raises(OSError) as e:  # not ours: left to the driver
            ioctl(gpu, iowr(REGISTER_FD, 4), buf)
        assert e.value.errno == errno.EINVAL
        buf = ctypes.create_string_buffer(struct.pack("=i", ctl))
        assert ioctl(gpu, iowr(REGISTER_FD, 4), buf) == 0
        assert struct.unpack("=i", buf.raw[:4])[0] == ctl
        assert len(os.listdir("/proc/self/fd")) == nfds
        # The same through the slow path.
        start(responders, responder_bin, "-f", f"gpu:{REGISTER_FD}:4:-:-:-:")
        gpu2 = vg.open("nvidia0")
        ctl2 = vg.open()
        try:
            buf = ctypes.create_string_buffer(struct.pack("=i", ctl2))
            assert ioctl(gpu2, iowr(REGISTER_FD, 4), buf) == 0
            assert struct.unpack("=i", buf.raw[:4])[0] == ctl2
        finally:
            os.close(gpu2)
            os.close(ctl2)
    finally:
        os.close(other)
        os.close(gpu)
        os.close(ctl)


def test_stats_counters(vg: Env) -> None:
    before = stats()
    assert before["version"] == PROTO_VERSION
    fds = [vg.open() for _ in range(3)]
    mid = stats()
    for fd in fds:
        os.close(fd)
    after = stats()
    assert mid["contexts"] == before["contexts"] + 3
    assert mid["opens"] == before["opens"] + 3
    assert after["contexts"] == before["contexts"]

KILLED_CALLER = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
buf = ctypes.create_string_buffer(struct.pack("=IIIIQII", 0, 0, 0, 0x40, 0, 0, 0))
print("calling", flush=True)
libc.ioctl(fd, %d, ctypes.addressof(buf))
print("returned", flush=True)
"""


def test_rmmod_refused_open_and_caller_killed(vg: Env) -> None:
    fd = vg.open()
    res = rmmod("vgpu")
    os.close(fd)
    assert res.returncode != 0 and loaded("vgpu")

    g = Genl()
    try:
        g.register()
        g.set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
        before = stats()
        code = KILLED_CALLER % iowr(RM_ALLOC, NVOS21.size)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT)
        hdr, _ = g.next_upcall(timeout=30)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert "returned" not in child.stdout.read()
        with pytest.raises(NlError) as e:
            g.verdict(hdr[0], ALLOW)
        assert e.value.errno == errno.ENOENT
        after = stats()
        assert after["killed"] == before["killed"] + 1
        assert after["lost"] == before["lost"] + 1
        assert after["contexts"] == before["contexts"]
    finally:
        g.close()
    # The module unloads now that nothing is open, and loads again.
    params = {p: Path(f"/sys/module/vgpu/parameters/{p}").read_text().strip()
              for p in ("backing_dir", "backing_driver", "backing_uvm_driver",
                        "upcall_timeout_ms")}
    wait_for(lambda: stats()["daemon_portid"] == 0, what="daemon socket release")
    res = rmmod("vgpu")
    assert res.returncode == 0, res.stderr
    assert not loaded("vgpu")
    insmod(ROOT / "kmod/vgpu/vgpu.ko", *(f"{k}={v}" for k, v in params.items()))
    wait_path(VGPU_DIR / "nvidiactl")


def test_kmemleak_clean(vg: Env) -> None:
    leak = Path("/sys/kernel/debug/kmemleak")
    if not leak.exists():
        pytest.skip("kernel without CONFIG_DEBUG_KMEMLEAK")
    leak.write_text("scan")
    report = leak.read_text()
    assert "vgpu" not in report, report
