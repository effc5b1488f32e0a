"""QuotaPolicy through the Dispatcher with upcalls and events built as the module
builds them (tests.support.fakekernel), for the policy tests of the host tier."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

from tests.support.fakekernel import (
    FAMILY,
    abandoned_event_msg,
    close_event_msg,
    post_event_msg,
    upcall_msg,
)
from vgpud.admin.manager import Manager
from vgpud.core.ledger import Denied, Ledger
from vgpud.kernel import codec
from vgpud.kernel.uapi import ALLOW, VERDICT_F_POST, UpcallKind, Verdict, VerdictAction
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.events import QuotaEvent, QuotaExceeded
from vgpud.policy.quota import QuotaPolicy
from vgpud.store.config import parse_config
from vgpud.store.journal import ChargeAndGroupJournal, Identity
from vgpud.store.state import RuntimeState

GIB = 2**30
GPUS = [(0, "sim", 4 * GIB), (1, "sim", 4 * GIB)]
CONFIG = """\
[daemon]
state_path = "{state}"

[[tenant]]
name = "a"
memory = "1GiB"
match = [{{ uid = 1000 }}]

[[tenant]]
name = "b"
memory = "2GiB"
uvm = "deny"
gpus = [1]
match = [{{ cgroup = "/pods/b*" }}]

[[tenant]]
name = "c"
uvm = "allow"
match = [{{ uid = 3000 }}]
"""

class World:
    def __init__(self, tmp: Path, default: str | None = None, *,
                 journal: Path | None = None, truth: bool = False) -> None:
        text = CONFIG.format(state=tmp / "state.json")
        if default:
            text = text.replace("[daemon]\n", f'[daemon]\ndefault_tenant = "{default}"\n')
        (tmp / "vgpud.toml").write_text(text)
        config = parse_config(text)
        self.ledger = Ledger()
        self.processes: dict[int, int] = {}  # pid -> start (clock ticks), for bindings
        self.manager = Manager(tmp / "vgpud.toml", config, RuntimeState(), self.ledger, GPUS,
                               process_start=self.processes.get, boot_id="boot-1")
        self.denied: list[Denied] = []
        self.cgroups: dict[int, str] = {}
        self.journal = None if journal is None else ChargeAndGroupJournal.resume(
            journal, self.ledger, Identity("boot", "vgpu"))
        if self.journal is not None:
            self.ledger.observers.subscribe(self.journal)
        # truth=False: charges settle on POST events, from the results (the
        # driver-truth path has tests of its own, tests/unit/test_truth.py).
        self.policy = QuotaPolicy(self.manager, self.ledger, cgroup_path=self.cgroups.get,
                                  truth=truth)
        self.policy.observers.subscribe(self.manager)
        self.policy.observers.subscribe(self)
        self.d = Dispatcher(self.policy)
        self.ids = itertools.count(1)
        self.handles = itertools.count(0x1000)
        self.uids: dict[int, int] = {}

    def notify(self, event: QuotaEvent) -> None:
        if isinstance(event, QuotaExceeded):
            self.denied.append(event.denied)

    # -- raw messages --

    def upcall(self, ctx: int, params: bytes = b"", data: bytes | None = None,
               **kw) -> tuple[int, Verdict]:
        uid = next(self.ids)
        kw.setdefault("uid", self.uids.get(ctx, 1000))
        (msg,) = codec.decode_datagram(upcall_msg(params, data, id=uid, ctx_id=ctx, **kw),
                                       FAMILY)
        assert isinstance(msg, codec.Upcall), msg
        return uid, self.d.on_upcall(msg)

    def post_upcall(self, ctx: int, uid: int, nr: int, params: bytes,
                    data: bytes | None = None, ret: int = 0, **kw) -> Verdict:
        (msg,) = codec.decode_datagram(upcall_msg(
            params, data, id=uid, ctx_id=ctx, kind=UpcallKind.POST, nr=nr, ret=ret,
            uid=self.uids.get(ctx, 1000), **kw), FAMILY)
        return self.d.on_upcall(msg)

    def post(self, ctx: int, uid: int, nr: int, params: bytes, ret: int = 0) -> None:
        (msg,) = codec.decode_datagram(post_event_msg(ctx, uid, nr, ret, params), FAMILY)
        self.d.on_event(msg)

    def open(self, ctx: int, uid: int = 1000, cgroup: str = "/",
             tgid: int = 100, start_ns: int | None = None) -> Verdict:
        self.uids[ctx] = uid
        return self.upcall(ctx, kind=UpcallKind.OPEN, cgroup=cgroup, uid=uid, tgid=tgid,
                           start_ns=start_ns)[1]

    def close(self, ctx: int) -> None:
        (msg,) = codec.decode_datagram(close_event_msg(ctx), FAMILY)
        self.d.on_event(msg)

    def abandon(self, ctx: int, upcall_id: int, kind: UpcallKind = UpcallKind.IOCTL) -> None:
        """The module gave up on upcall `upcall_id` (its caller timed out)."""
        (msg,) = codec.decode_datagram(abandoned_event_msg(ctx, upcall_id, kind), FAMILY)
        self.d.on_event(msg)

    def mem_upcall(self, ctx: int, client: int, parent: int, size: int) -> tuple[int, Verdict]:
        """The RM_ALLOC upcall of `size` bytes alone: no POST follows."""
        return self.upcall(ctx, _alloc_params(client, parent, 0, 0x40, 21, _mem(size)),
                           _mem(size), nr=Escape.RM_ALLOC)

    # -- RM calls (NVOS21 unless told) --

    def rm_alloc(self, ctx: int, client: int, parent: int, h_class: int,
                 alloc: bytes | None = None, h_new: int = 0, nvos: int = 21,
                 status: int = 0, flags: int = 0) -> tuple[Verdict, int]:
        """RM_ALLOC upcall and, if allowed, its POST event; (verdict, new handle)."""
        params = _alloc_params(client, parent, 0 if h_new is None else h_new, h_class, nvos,
                               alloc)
        uid, verdict = self.upcall(ctx, params, alloc, nr=Escape.RM_ALLOC, flags=flags)
        handle = h_new or next(self.handles)
        if verdict.action is VerdictAction.ALLOW and not verdict.flags & VERDICT_F_POST:
            after = _alloc_params(client, parent, handle, h_class, nvos, alloc, status)
            self.post(ctx, uid, Escape.RM_ALLOC, after)
        return verdict, handle

    def client(self, ctx: int) -> int:
        return self.rm_alloc(ctx, 0, 0, 0x41)[1]

    def device(self, ctx: int, client: int, gpu: int) -> tuple[int, int]:
        dev_params = L.NV0080_ALLOC_PARAMETERS.struct.pack(gpu, 0, 0, 0, 0, 0, 0, 0, 0)
        device = self.rm_alloc(ctx, client, client, 0x80, dev_params)[1]
        sub = self.rm_alloc(ctx, client, device, 0x2080, struct.pack("=I", 0))[1]
        return device, sub

    def mem(self, ctx: int, client: int, parent: int, size: int, **kw) -> tuple[Verdict, int]:
        return self.rm_alloc(ctx, client, parent, 0x40, _mem(size), **kw)

    def free(self, ctx: int, client: int, handle: int, status: int = 0) -> Verdict:
        params = L.NVOS00.struct.pack(client, client, handle, 0)
        uid, verdict = self.upcall(ctx, params, nr=Escape.RM_FREE)
        self.post(ctx, uid, Escape.RM_FREE, L.NVOS00.struct.pack(client, client, handle, status))
        return verdict

    def used(self, tenant: str, gpu: int = 0) -> int:
        return self.ledger.usage(tenant, gpu).used


def _mem(size: int) -> bytes:
    values = [0] * 23
    values[13] = size
    return L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*values)


def _alloc_params(client, parent, h_new, h_class, nvos, alloc, status=0) -> bytes:
    """NVOS21/NVOS64 as libcuda sends them: paramsSize 0 (the driver reads the
    alloc params by their class's size; the module copies them so)."""
    ptr = 0 if alloc is None else 0x7F0000001000
    if nvos == 21:
        return L.NVOS21.struct.pack(client, parent, h_new, h_class, ptr, 0, status)
    return L.NVOS64.struct.pack(client, parent, h_new, h_class, ptr, 0, 0, 0, status)


def setup_gpu(w: World, ctx: int, gpu: int = 0, uid: int = 1000,
              cgroup: str = "/") -> tuple[int, int, int]:
    assert w.open(ctx, uid, cgroup) == ALLOW
    client = w.client(ctx)
    device, sub = w.device(ctx, client, gpu)
    return client, device, sub
