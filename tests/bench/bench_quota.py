"""Decisions per second of the quota daemon's core, with the codec, on one core.

Datagrams built byte for byte as the module builds them (tests/support/fakekernel.py)
are decoded with vgpud.kernel.codec, dispatched to the QuotaPolicy (Manager,
Ledger) through the Dispatcher, and every upcall's verdict is encoded, as
GenlChannel does minus the socket. 64 tenants (8 per GPU, 8 GPUs), 4 contexts
each with a client, device and subdevice, hold 10,000 live allocations; then a
realistic mix runs: an allocation (RM_ALLOC upcall + POST event; 1 in 20 fails
in the driver), a free of an old one when over 10,000 (RM_FREE upcall + POST
event), 1 in 32 a dup (RM_DUP_OBJECT upcall + POST event), 1 in 16 an
FB_GET_INFO_V2 (upcall + POST upcall answered with REPLY); every 8th tenant
sits at its limit, so its allocations are refused (FAIL_STATUS 0x51).

A decision is one upcall decoded, decided and its verdict encoded; the time
also covers the POST events that complete the calls. With --journal DIR the
ledger's changes are journaled there too (vgpud.store.journal; use a tmpfs).

    .venv/bin/python tests/bench/bench_quota.py [--ops N] [--journal /dev/shm/x]

Target: >= 50,000 decisions/s.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from collections import Counter
from pathlib import Path

# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.fakekernel import FAMILY, post_event_msg, upcall_msg
from vgpud.admin.manager import Manager
from vgpud.core.ledger import Ledger
from vgpud.kernel import codec
from vgpud.kernel.codec import Upcall
from vgpud.kernel.uapi import UpcallKind, VerdictAction
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvClass, NvStatus
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.quota import QuotaPolicy
from vgpud.store.config import parse_config
from vgpud.store.journal import ChargeAndGroupJournal, Identity
from vgpud.store.state import RuntimeState

TENANTS = 64
GPUS = 8
CONTEXTS_PER_TENANT = 4
LIVE = 10_000
MiB, GiB = 2**20, 2**30
TIGHT = 4 * MiB * 16  # limit of every 8th tenant: full after setup
CLIENT_BASE = 0xC1D00000
DEVICE, SUBDEVICE = 0x80, 0x2080
FB_INDEXES = (7, 8, 9, 0x10, 0x16, 0x20)
CHUNK = 5_000


def config_text(state: str = "/nonexistent/state.json",
                charges: str = "/nonexistent/charges") -> str:
    lines = ["[daemon]", f'state_path = "{state}"', f'charges_path = "{charges}"', ""]
    for t in range(TENANTS):
        memory = f"{TIGHT}" if t % 8 == 7 else "8GiB"
        lines += ["[[tenant]]", f'name = "tenant-{t}"', f'memory = "{memory}"',
                  f"gpus = [{t % GPUS}]", f"match = [{{ uid = {10_000 + t} }}]", ""]
    return "\n".join(lines)


class Kernel:
    """Builds the datagrams of one workload, and the verdict actions they must get."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = 0
        self.handles = 0x100000
        self.contexts = list(range(1, TENANTS * CONTEXTS_PER_TENANT + 1))
        self.live: list[tuple[int, int]] = []  # (ctx, handle) of a free-able allocation
        self.out: list[bytes] = []
        self.expected: Counter[VerdictAction] = Counter()

    @staticmethod
    def tenant(ctx: int) -> int:
        return (ctx - 1) // CONTEXTS_PER_TENANT

    def upcall(self, ctx: int, params: bytes, data: bytes | None, nr: int,
               expect: VerdictAction, **kw: int) -> int:
        self.ids += 1
        kw.setdefault("uid", 10_000 + self.tenant(ctx))
        self.out.append(upcall_msg(params, data, id=self.ids, ctx_id=ctx, nr=nr, **kw))
        self.expected[expect] += 1
        return self.ids

    def open(self, ctx: int) -> None:
        self.upcall(ctx, b"", None, 0, VerdictAction.ALLOW, kind=UpcallKind.OPEN)
        client = CLIENT_BASE + ctx
        gpu = self.tenant(ctx) % GPUS
        dev = L.NV0080_ALLOC_PARAMETERS.struct.pack(gpu, 0, 0, 0, 0, 0, 0, 0, 0)
        for parent, handle, h_class, data in (
            (0, client, NvClass.ROOT_CLIENT, None),
            (client, DEVICE, NvClass.DEVICE_0, dev),
            (DEVICE, SUBDEVICE, NvClass.SUBDEVICE_0, struct.pack("=I", 0)),
        ):
            root = client if h_class != NvClass.ROOT_CLIENT else 0
            self.rm_alloc(ctx, root, parent, handle, h_class, data, NvStatus.OK)

    def rm_alloc(self, ctx: int, client: int, parent: int, handle: int, h_class: int,
                 data: bytes | None, status: int | None) -> None:
        """The upcall; then, unless refused (status None), its POST event."""
        size = 0 if data is None else len(data)
        before = L.NVOS21.struct.pack(client, parent, 0, h_class, 0x7F0000001000, size, 0)
        expect = VerdictAction.ALLOW if status is not None else VerdictAction.FAIL_STATUS
        uid = self.upcall(ctx, before, data, Escape.RM_ALLOC, expect)
        if status is not None:
            after = L.NVOS21.struct.pack(client, parent, handle, h_class, 0x7F0000001000, size,
                                         status)
            self.out.append(post_event_msg(ctx, uid, Escape.RM_ALLOC, 0, after, data))

    def memory(self, ctx: int, size: int, fails: bool = False) -> None:
        values = [0] * 23
        values[13] = size
        data = L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*values)
        tight = self.tenant(ctx) % 8 == 7
        status = None if tight and self.ready else NvStatus.NO_MEMORY if fails else NvStatus.OK
        self.handles += 1
        self.rm_alloc(ctx, CLIENT_BASE + ctx, DEVICE, self.handles, NvClass.MEMORY_LOCAL_USER,
                      data, status)
        if status == NvStatus.OK and not tight:
            self.live.append((ctx, self.handles))

    def free(self) -> None:
        j = self.rng.randrange(len(self.live))
        self.live[j], self.live[-1] = self.live[-1], self.live[j]
        ctx, handle = self.live.pop()
        client = CLIENT_BASE + ctx
        params = L.NVOS00.struct.pack(client, DEVICE, handle, 0)
        uid = self.upcall(ctx, params, None, Escape.RM_FREE, VerdictAction.ALLOW)
        self.out.append(post_event_msg(ctx, uid, Escape.RM_FREE, 0, params))

    def dup(self, ctx: int) -> None:
        src_ctx, src = self.live[self.rng.randrange(len(self.live))]
        client = CLIENT_BASE + ctx
        self.handles += 1
        before = L.NVOS55.struct.pack(client, DEVICE, 0, CLIENT_BASE + src_ctx, src, 0, 0)
        uid = self.upcall(ctx, before, None, Escape.RM_DUP_OBJECT, VerdictAction.ALLOW)
        after = L.NVOS55.struct.pack(client, DEVICE, self.handles, CLIENT_BASE + src_ctx, src,
                                     0, 0)
        self.out.append(post_event_msg(ctx, uid, Escape.RM_DUP_OBJECT, 0, after))
        self.live.append((ctx, self.handles))

    def fb_info(self, ctx: int) -> None:
        client = CLIENT_BASE + ctx
        ctrl = L.NVOS54.struct.pack(client, SUBDEVICE, Ctrl.FB_GET_INFO_V2, 0, 0x7F0000002000,
                                    L.NV2080_CTRL_FB_GET_INFO_V2_PARAMS.size, 0)
        flat = [v for i in FB_INDEXES for v in (i, 80 * GiB >> 10)]
        flat += [0] * (256 - len(flat))
        data = L.NV2080_CTRL_FB_GET_INFO_V2_PARAMS.struct.pack(len(FB_INDEXES), *flat)
        uid = self.upcall(ctx, ctrl, data, Escape.RM_CONTROL, VerdictAction.ALLOW)
        self.ids -= 1  # the POST upcall has the same id
        self.upcall(ctx, ctrl, data, Escape.RM_CONTROL, VerdictAction.REPLY,
                    kind=UpcallKind.POST)
        assert self.ids == uid

    ready = False

    def setup(self) -> None:
        for ctx in self.contexts:
            self.open(ctx)
        for ctx in self.contexts:
            if self.tenant(ctx) % 8 == 7:  # 16 x 4 MiB per tenant: exactly at its limit
                for _ in range(16 // CONTEXTS_PER_TENANT):
                    self.memory(ctx, 4 * MiB)
        while len(self.live) < LIVE:
            ctx = self.rng.choice(self.contexts)
            if self.tenant(ctx) % 8 != 7:
                self.memory(ctx, self.rng.choice((1, 2, 4, 8)) * MiB)
        self.ready = True

    def op(self, i: int) -> None:
        ctx = self.rng.choice(self.contexts)
        self.memory(ctx, self.rng.choice((1, 2, 4, 8, 16)) * MiB, fails=i % 20 == 0)
        if i % 32 == 0 and self.tenant(ctx) % 8 != 7:
            self.dup(ctx)
        if i % 16 == 0:
            self.fb_info(ctx)
        while len(self.live) > LIVE:
            self.free()

    def take(self) -> list[bytes]:
        out, self.out = self.out, []
        return out


def process(datagrams: list[bytes], dispatcher: Dispatcher, verdicts: list) -> tuple[int, int]:
    """What GenlChannel._dispatch does for each datagram, minus the socket.
    Returns (upcalls, events)."""
    decode, on_upcall, on_event = codec.decode_datagram, dispatcher.on_upcall, dispatcher.on_event
    encode = codec.VerdictEncoder(FAMILY).encode
    append = verdicts.append
    upcalls = events = 0
    for buf in datagrams:
        for msg in decode(buf, FAMILY):
            if type(msg) is Upcall:
                verdict = on_upcall(msg)
                encode(msg.id, verdict)
                append(verdict.action)
                upcalls += 1
            else:
                on_event(msg)
                events += 1
    return upcalls, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000, help="allocation attempts")
    parser.add_argument("--journal", type=Path, help="journal the ledger in this directory")
    args = parser.parse_args()

    config = parse_config(config_text())
    ledger = Ledger()
    gpus = [(g, "NVIDIA H100 (sim)", 80 * GiB) for g in range(GPUS)]
    manager = Manager("/nonexistent/vgpud.toml", config, RuntimeState(), ledger, gpus)
    journal = None
    if args.journal is not None:
        args.journal.mkdir(parents=True, exist_ok=True)
        journal = ChargeAndGroupJournal(args.journal / "charges", Identity("bench", "bench"),
                                        ledger)
        assert journal.start()
        ledger.observers.subscribe(journal)
    dispatcher = Dispatcher(QuotaPolicy(manager, ledger, truth=False))
    kernel = Kernel(seed=1)
    verdicts: list[VerdictAction] = []
    kernel.setup()
    process(kernel.take(), dispatcher, verdicts)

    upcalls = events = 0
    elapsed = 0.0
    for start in range(0, args.ops, CHUNK):
        for i in range(start, min(start + CHUNK, args.ops)):
            kernel.op(i)
        chunk = kernel.take()
        # CPU time of this (single-threaded) process: the figure holds on a
        # shared host, where wall time counts other processes' turns.
        t0 = time.process_time()
        u, e = process(chunk, dispatcher, verdicts)
        elapsed += time.process_time() - t0
        upcalls, events = upcalls + u, events + e

    got = Counter(verdicts)
    if got != kernel.expected or dispatcher.counters.policy_errors:
        sys.exit(f"unexpected verdicts: {dict(got)} != {dict(kernel.expected)}, "
                 f"counters {dispatcher.counters}")
    charged = sum(u.charged for u in ledger.snapshot())
    print(f"tenants {TENANTS} on {GPUS} GPUs, contexts {len(kernel.contexts)}, "
          f"live allocations {len(kernel.live)} ({charged / GiB:.1f} GiB charged)")
    print(f"upcalls {upcalls} + POST events {events} in {elapsed:.2f} s of CPU; verdicts: "
          + ", ".join(f"{a.name} {n}" for a, n in sorted(got.items())))
    print(f"rate {upcalls / elapsed:,.0f} decisions per CPU second (target >= 50,000); "
          f"{(upcalls + events) / elapsed:,.0f} messages per CPU second")
    if journal is not None:
        print(f"journal {journal.path}: {journal.path.stat().st_size / 2**20:.1f} MiB, "
              f"{journal.compactions} compactions")
        journal.close()


if __name__ == "__main__":
    main()
