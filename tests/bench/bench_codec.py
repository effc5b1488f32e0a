"""Host micro-benchmark of the upcall hot path, per upcall:
decode (netlink + upcall + NVIDIA params) -> policy -> verdict encode, and the
whole channel path (recv, decode, dispatch, send, recv to EAGAIN) against a
minimal struct responder, both over a socketpair standing in for the kernel.

Run: .venv/bin/python tests/bench/bench_codec.py [-n N]
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.fakekernel import FAMILY, upcall_msg
from tests.support.policies import AllowAll, DenyClasses
from vgpud.kernel import codec
from vgpud.kernel.channel import GenlChannel
from vgpud.kernel.uapi import ALLOW
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape, NvClass
from vgpud.policy.dispatch import Dispatcher


def measure(fn: Callable[[], object], n: int) -> float:
    """Best of 5 runs, in ns per call."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def channel_path(buf: bytes, dispatcher: Dispatcher) -> tuple[Callable[[], object], ...]:
    """One upcall per wakeup, as a synchronous caller makes them: the fake kernel
    sends it, the reader handles it and answers, the fake kernel reads the verdict.
    Returns that round for GenlChannel and for a minimal struct responder."""
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    channel = GenlChannel(ours, FAMILY, dispatcher)
    send, recv, on_readable = kernel.send, kernel.recv, channel._on_readable

    def vgpud() -> bytes:
        send(buf)
        on_readable()
        return recv(4096)

    m_kernel, m_ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    m_ours.setblocking(False)
    m_send, m_recv = m_kernel.send, m_kernel.recv
    r_recv, r_send = m_ours.recv, m_ours.send
    unpack_id = struct.Struct("=20xQ").unpack_from
    allow = codec.VerdictEncoder(FAMILY).encode

    def minimal() -> bytes:
        m_send(buf)
        while True:
            try:
                upcall = r_recv(65536)
            except BlockingIOError:
                break
            r_send(allow(unpack_id(upcall)[0], ALLOW))
        return m_recv(4096)

    return vgpud, minimal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=100_000)
    n = parser.parse_args().n

    mem = L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*[0] * 13, 1 << 30, *[0] * 9)
    alloc = L.NVOS21.struct.pack(1, 2, 3, NvClass.MEMORY_LOCAL_USER, 0x1000, 128, 0)
    buf = upcall_msg(alloc, mem, id=1, nr=Escape.RM_ALLOC)
    encode = codec.VerdictEncoder(FAMILY).encode
    decode = codec.decode_datagram
    deny = Dispatcher(DenyClasses({NvClass.MEMORY_LOCAL_USER}))
    allow = Dispatcher(AllowAll())
    ctrl = L.NVOS54.struct.pack(1, 2, 0xDEAD0001, 0, 0x1000, 0, 0)
    ctrl_buf = upcall_msg(ctrl, id=1, nr=Escape.RM_CONTROL)
    (upcall,) = decode(buf, FAMILY)
    vgpud_round, minimal_round = channel_path(ctrl_buf, Dispatcher(AllowAll()))
    verdict = deny.on_upcall(upcall)

    def full(dispatcher: Dispatcher) -> Callable[[], object]:
        on_upcall = dispatcher.on_upcall

        def run() -> bytes:
            (msg,) = decode(buf, FAMILY)
            return encode(msg.id, on_upcall(msg))
        return run

    cases = {
        "decode_datagram (RM_ALLOC upcall, 128 B data)": lambda: decode(buf, FAMILY),
        "decode_call (NVOS21 + memory params)": lambda: L.decode_call(
            Escape.RM_ALLOC, upcall.params, upcall.data),
        "dispatcher.on_upcall (deny-class:0x40)": lambda: deny.on_upcall(upcall),
        "verdict encode": lambda: encode(1, verdict),
        "full: decode + allow-all + encode": full(allow),
        "full: decode + deny-class + encode": full(deny),
        "channel round, RM_CONTROL, allow-all": vgpud_round,
        "minimal struct responder round": minimal_round,
    }
    print(f"{'per upcall':48} {'ns/op':>9} {'ops/s':>12}")
    for name, fn in cases.items():
        ns = measure(fn, n)
        print(f"{name:48} {ns:9.0f} {1e9 / ns:12,.0f}")


if __name__ == "__main__":
    main()
