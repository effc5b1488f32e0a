"""Host micro-benchmark of the upcall hot path, per upcall:
decode (netlink + upcall + NVIDIA params) -> policy -> verdict encode.

Run: .venv/bin/python tests/bench/bench_codec.py [-n N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from fakekernel import FAMILY, upcall_msg

from vgpud.daemon import Dispatcher
from vgpud.kernel import codec
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape, NvClass
from vgpud.policy import AllowAll, DenyClasses


def measure(fn: Callable[[], object], n: int) -> float:
    """Best of 5 runs, in ns per call."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


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
    (upcall,) = decode(buf, FAMILY)
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
    }
    print(f"{'per upcall':48} {'ns/op':>9} {'ops/s':>12}")
    for name, fn in cases.items():
        ns = measure(fn, n)
        print(f"{name:48} {ns:9.0f} {1e9 / ns:12,.0f}")


if __name__ == "__main__":
    main()
