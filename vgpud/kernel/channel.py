"""The vgpu generic netlink channel on an asyncio loop.

The family id is looked up once at start (nlctrl's GETFAMILY). Everything
goes through raw NETLINK_GENERIC sockets; the channel's is watched with
``loop.add_reader``: one
recv, ``codec.decode_datagram``, the handler's verdict, one ``send`` of a
prebuilt-header verdict without ACK. Control requests (REGISTER, SET_FILTER,
GET_STATS, UNREGISTER) go out on the same socket, because the module unicasts
upcalls to the port that registered; their replies are matched by sequence
number in the same reader.

Only the kernel speaks on the socket: it is connected to the kernel (nl_pid
0), so that the kernel refuses unicasts to it from any other port (a process
with CAP_NET_ADMIN could otherwise send the daemon forged upcalls and
events), and a datagram from any other source is dropped and counted.

The channel takes any datagram socket in its constructor, so tests drive it
with one end of ``socketpair(AF_UNIX, SOCK_DGRAM)`` standing in for the
kernel; ``GenlChannel.open`` makes the real netlink socket.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vgpud.kernel import codec, uapi
from vgpud.kernel.codec import (
    AbandonedEvent,
    CloseEvent,
    DecodeError,
    Event,
    NlAck,
    PostEvent,
    Reply,
    RevokedEvent,
    Upcall,
)
from vgpud.kernel.uapi import (
    Context,
    Filter,
    ObjOp,
    ObjQuery,
    ObjResult,
    Sched,
    SchedResult,
    Stats,
    Stats4,
    Verdict,
)

__all__ = [
    "AlreadyRegistered",
    "ChannelError",
    "ChannelStats",
    "FamilyNotFound",
    "GenlChannel",
    "NotPermitted",
    "ProtocolMismatch",
    "RequestFailed",
    "UpcallHandler",
    "query_module_contexts",
    "query_module_counters",
    "query_module_stats",
    "resolve_family",
]

log = logging.getLogger(__name__)

NETLINK_GENERIC = 16  # missing from Python's socket module
SOL_NETLINK = 270
NETLINK_EXT_ACK = 11
SO_RCVBUFFORCE = 33
# 8 MiB asked, 16 MiB granted: room for every upcall the module lets be in
# flight at once (upcalls_max, default 64, each at most 2 x VGPU_PARAMS_MAX of
# blocks, about 64 KiB of buffer) and the event each may leave queued, twice
# over (docs/architecture.md, Concurrency model).
RCVBUF = 8 << 20
RECV_SIZE = 1 << 16  # above VGPU_PARAMS_MAX twice (params + data) plus headers
BATCH = 64  # datagrams handled per wakeup before yielding to the loop
REQUEST_TIMEOUT = 5.0
# The family lookup may wait for the kernel to load the module claiming it.
RESOLVE_TIMEOUT = 60.0
KERNEL = (0, 0)  # a netlink unicast's source address from the kernel: nl_pid 0, no group
FOREIGN_LOG_INTERVAL = 10.0  # seconds between warnings of dropped foreign datagrams


class ChannelError(Exception):
    """The channel cannot do what was asked; the message says why, for humans."""


class FamilyNotFound(ChannelError):
    pass


class ProtocolMismatch(ChannelError):
    pass


class AlreadyRegistered(ChannelError):
    pass


class NotPermitted(ChannelError):
    pass


class RequestFailed(ChannelError):
    def __init__(self, what: str, err: int, detail: str | None = None) -> None:
        text = f"{what} failed: {os.strerror(err)}" + (f" ({detail})" if detail else "")
        super().__init__(text)
        self.errno = err
        self.detail = detail


class UpcallHandler(Protocol):
    """What the channel hands decoded messages to; must not raise."""

    def on_upcall(self, upcall: Upcall) -> Verdict | ObjQuery: ...

    def on_event(self, event: Event) -> None: ...

    def on_malformed(self, error: DecodeError) -> Verdict | None:
        """A message that did not decode; a verdict answers ``error.upcall_id``."""
        ...


@dataclass(slots=True)
class ChannelStats:
    datagrams: int = 0
    verdicts_sent: int = 0
    send_errors: int = 0
    enobufs: int = 0  # receive queue overruns: upcalls lost, the module times them out
    refused_verdicts: int = 0  # NLMSG_ERROR for a verdict (e.g. -ENOENT when late)
    foreign: int = 0  # datagrams not from the kernel, dropped


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[list[Reply]]
    replies: list[Reply] = field(default_factory=list)


def _resolve_family_sync(name: str) -> int:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_GENERIC) as sock:
        sock.settimeout(RESOLVE_TIMEOUT)
        sock.bind((0, 0))
        sock.connect(KERNEL)
        sock.send(codec.encode_get_family(name, 1))
        answer = codec.decode_family_id(sock.recv(RECV_SIZE), 1)
    if isinstance(answer, NlAck):
        raise OSError(answer.errno, os.strerror(answer.errno))
    return answer


async def resolve_family(name: str = uapi.GENL_NAME) -> int:
    """The generic netlink family id of ``name``, asked of nlctrl.

    A blocking socket in a worker thread: the answer may wait for the
    kernel, as a family the kernel does not know makes it load the module
    that claims it (vgpu.ko's MODULE_ALIAS_GENL_FAMILY) first, so an
    installed module is loaded here; ENOENT means no module could be.
    This is setup, once per channel. (Not pyroute2: its package imports
    all of pyroute2, half the daemon's import time; docs/performance.md.)
    """
    try:
        return await asyncio.get_running_loop().run_in_executor(
            None, _resolve_family_sync, name)
    except (OSError, DecodeError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            raise FamilyNotFound(
                f"generic netlink family {name!r} not found: is vgpu.ko loaded?"
                " (the kernel loads it on demand only when modprobe finds it)"
            ) from None
        raise ChannelError(f"resolving generic netlink family {name!r}: {exc}") from exc


class GenlChannel:
    def __init__(
        self, sock: socket.socket, family_id: int, handler: UpcallHandler | None = None,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        # Where the kernel's datagrams come from; a socketpair stand-in's peer is unnamed.
        self._kernel = KERNEL if sock.family == socket.AF_NETLINK else None
        self._foreign_logged = -FOREIGN_LOG_INTERVAL
        self._family_id = family_id
        self._handler = handler
        self._encode_verdict = codec.VerdictEncoder(family_id).encode
        self._pending: dict[int, _Pending] = {}
        self._queries: set[asyncio.Future[None]] = set()  # verdicts waiting for OBJECT
        self._seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Future[None] | None = None
        self.stats = ChannelStats()

    @classmethod
    async def open(
        cls, handler: UpcallHandler | None = None, *, rcvbuf: int = RCVBUF,
    ) -> GenlChannel:
        """Resolve the family, open and bind the netlink socket, start reading."""
        family_id = await resolve_family()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                             NETLINK_GENERIC)
        try:
            sock.bind((0, 0))
            sock.connect(KERNEL)  # the kernel refuses unicasts to us from other ports
            _set_rcvbuf(sock, rcvbuf)
            sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        except OSError:
            sock.close()
            raise
        # The kernel doubles what it is asked for (bookkeeping overhead); the
        # module's upcall slots (upcalls_max) are sized for RCVBUF.
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        if got < rcvbuf:
            log.warning("netlink receive buffer is %d KiB, below the %d KiB asked for "
                        "(net.core.rmem_max, and not root?): a burst of upcalls may "
                        "overflow it", got >> 10, rcvbuf >> 10)
        channel = cls(sock, family_id, handler)
        channel.start()
        return channel

    @property
    def family_id(self) -> int:
        return self._family_id

    def start(self) -> None:
        """Watch the socket on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    async def wait_closed(self) -> None:
        """Returns when the socket failed or was closed."""
        assert self._closed is not None, "start() first"
        await asyncio.shield(self._closed)

    def close(self) -> None:
        if self._loop is not None and self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._finish(ChannelError("channel closed"))

    # -- control requests -------------------------------------------------

    async def register(self, version: int = uapi.PROTO_VERSION) -> None:
        """Become the module's responder (VGPU_CMD_REGISTER + VGPU_A_VERSION)."""
        try:
            await self._request("register", lambda seq: codec.encode_register(
                self._family_id, seq, version))
        except RequestFailed as exc:
            if exc.errno == errno.EPROTONOSUPPORT:
                theirs = await self._module_version()
                raise ProtocolMismatch(
                    f"module speaks protocol v{theirs}, daemon v{version}") from None
            if exc.errno == errno.EBUSY:
                raise AlreadyRegistered(
                    "another vgpud is registered with the vgpu module") from None
            raise

    async def set_filter(self, filt: Filter) -> None:
        await self._request("set filter", lambda seq: codec.encode_set_filter(
            self._family_id, seq, filt))

    async def get_stats(self) -> Stats:
        return (await self.get_counters())[0]

    async def get_counters(self) -> tuple[Stats, Stats4 | None]:
        """The module's counters: struct vgpu_stats and, from a module that
        sends it, struct vgpu_stats4 (one GET_STATS)."""
        replies = await self._request("get stats", lambda seq: codec.encode_get_stats(
            self._family_id, seq))
        for reply in replies:
            if reply.cmd == uapi.Cmd.GET_STATS:
                return codec.decode_stats(reply), codec.decode_stats4(reply)
        raise ChannelError("GET_STATS got no VGPU_A_STATS reply")

    async def list_contexts(self) -> list[Context]:
        """Every live context, in ctx_id order, following the module's cursor.

        Pages are read one after another, not atomically: a context opened or
        closed meanwhile may or may not be listed.
        """
        contexts: list[Context] = []
        cursor = 0
        while True:
            replies = await self._request("list contexts", functools.partial(
                codec.encode_list_contexts, self._family_id, cursor=cursor))
            page, cursor = codec.decode_contexts(self._reply(replies, uapi.Cmd.LIST_CONTEXTS))
            contexts += page
            if not cursor:
                return contexts

    async def schedule(self, entries: Sequence[Sched]) -> list[SchedResult]:
        """Turn channel groups on/off, in order; one result per entry, same order.

        Above SCHED_MAX entries go out as several requests, in order. A refused
        request raises RequestFailed, EPERM included (this channel is not the
        registered daemon); the requests before it have been applied.
        """
        results: list[SchedResult] = []
        for start in range(0, len(entries), uapi.SCHED_MAX):
            chunk = entries[start : start + uapi.SCHED_MAX]
            try:
                replies = await self._request("schedule", functools.partial(
                    codec.encode_schedule, self._family_id, entries=chunk))
            except NotPermitted as exc:
                raise RequestFailed("schedule", errno.EPERM,
                                    str(exc).removeprefix("schedule: ")) from None
            results += codec.decode_sched_results(
                self._reply(replies, uapi.Cmd.SCHEDULE), len(chunk))
        return results

    async def object_ops(self, ops: Sequence[ObjOp]) -> list[ObjResult]:
        """The driver's truth about objects (VGPU_CMD_OBJECT), in order; one
        result per op. Above OBJ_MAX ops go out as several requests. A refused
        request raises RequestFailed (EPERM: not the registered daemon)."""
        results: list[ObjResult] = []
        for start in range(0, len(ops), uapi.OBJ_MAX):
            chunk = ops[start : start + uapi.OBJ_MAX]
            try:
                replies = await self._request("object", functools.partial(
                    codec.encode_object, self._family_id, ops=chunk))
            except NotPermitted as exc:
                raise RequestFailed("object", errno.EPERM,
                                    str(exc).removeprefix("object: ")) from None
            results += codec.decode_obj_results(
                self._reply(replies, uapi.Cmd.OBJECT), len(chunk))
        return results

    def _answer_later(self, upcall_id: int, query: ObjQuery) -> None:
        """A verdict that waits for the driver's truth: OBJECT, then resume."""
        task = asyncio.ensure_future(self._run_query(upcall_id, query))
        self._queries.add(task)
        task.add_done_callback(self._queries.discard)

    async def _run_query(self, upcall_id: int, query: ObjQuery) -> None:
        answer: Verdict | ObjQuery = query
        while isinstance(answer, ObjQuery):
            results: list[ObjResult] | None
            try:
                results = await self.object_ops(answer.ops)
            except (ChannelError, DecodeError) as exc:
                log.warning("upcall %d: the driver's truth was not read: %s", upcall_id, exc)
                results = None
            answer = answer.resume(results)
        self._send_verdict(upcall_id, answer)

    @staticmethod
    def _reply(replies: list[Reply], cmd: uapi.Cmd) -> Reply:
        for reply in replies:
            if reply.cmd == cmd:
                return reply
        raise ChannelError(f"{cmd.name} got no reply")

    async def unregister(self) -> None:
        await self._request("unregister", lambda seq: codec.encode_unregister(
            self._family_id, seq))

    async def _module_version(self) -> str:
        try:
            return str((await self.get_stats()).version)
        except (ChannelError, DecodeError):
            return "?"

    async def _request(self, what: str, build: Callable[[int], bytes]) -> list[Reply]:
        if self._closed is None or self._closed.done():
            raise ChannelError(f"{what}: channel is not running")
        self._seq = self._seq % 0x7FFFFFFF + 1  # seq 0 is the verdicts'
        seq = self._seq
        pending = _Pending(self._closed.get_loop().create_future())
        self._pending[seq] = pending
        try:
            self._sock.send(build(seq))
            # Not asyncio.wait_for: Python 3.11's returns the reply when a
            # cancel meets it, and the cancelled task (a stopping refresher)
            # would go on.
            async with asyncio.timeout(REQUEST_TIMEOUT):
                return await pending.future
        except RequestFailed as exc:
            if exc.errno == errno.EPERM:
                why = exc.detail or "the vgpu module needs CAP_NET_ADMIN"
                raise NotPermitted(f"{what}: {why}") from None
            raise RequestFailed(what, exc.errno, exc.detail) from None
        except TimeoutError:
            raise ChannelError(f"{what}: no answer from the vgpu module") from None
        except OSError as exc:
            raise ChannelError(f"{what}: {exc}") from exc
        finally:
            self._pending.pop(seq, None)

    # -- receive path -----------------------------------------------------

    def _on_readable(self) -> None:
        recv, dispatch, stats = self._sock.recvfrom, self._dispatch, self.stats
        kernel = self._kernel
        for _ in range(BATCH):
            try:
                buf, source = recv(RECV_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    stats.enobufs += 1
                    log.warning("netlink receive queue overrun: upcalls lost (%d so far)",
                                stats.enobufs)
                    continue
                log.error("netlink socket failed: %s", exc)
                self._fail(exc)
                return
            if not buf:  # netlink never sends empty datagrams: the stand-in peer left
                self._fail(ConnectionResetError("peer closed"))
                return
            stats.datagrams += 1
            if source != kernel:
                self._drop_foreign(source)
                continue
            dispatch(buf)

    def _drop_foreign(self, source: object) -> None:
        """A datagram that is not the kernel's: never decoded, counted, logged now and then."""
        self.stats.foreign += 1
        now = time.monotonic()
        if now - self._foreign_logged >= FOREIGN_LOG_INTERVAL:
            self._foreign_logged = now
            log.warning("dropped a netlink message from %r, not the kernel (%d so far)",
                        source, self.stats.foreign)

    def _dispatch(self, buf: bytes) -> None:
        handler = self._handler
        for msg in codec.decode_datagram(buf, self._family_id):
            # type() identity, not match: class patterns (isinstance) cost about 60 ns more
            # per message (timeit: 15-30 ns against 70-100 ns for this chain, CPython 3.11).
            if type(msg) is Upcall:
                if handler is None:
                    log.warning("upcall %d with no handler; left to time out", msg.id)
                    continue
                verdict = handler.on_upcall(msg)
                if isinstance(verdict, ObjQuery):
                    self._answer_later(msg.id, verdict)
                else:
                    self._send_verdict(msg.id, verdict)
            elif type(msg) is PostEvent or type(msg) is CloseEvent or type(msg) is AbandonedEvent:
                if handler is not None:
                    handler.on_event(msg)
            elif type(msg) is RevokedEvent:
                log.warning("the module revoked context %d (%s): its calls fail from now on",
                            msg.ctx_id, msg.reason.name.lower())
            elif type(msg) is NlAck:
                self._on_ack(msg)
            elif type(msg) is Reply:
                pending = self._pending.get(msg.seq)
                if pending is None:
                    log.debug("reply for unknown request %d", msg.seq)
                else:
                    pending.replies.append(msg)
            elif isinstance(msg, DecodeError):  # the only other kind decode_datagram gives
                self._on_malformed(msg)

    def _on_malformed(self, error: DecodeError) -> None:
        if self._handler is None:
            log.warning("malformed message: %s", error)
            return
        verdict = self._handler.on_malformed(error)
        if verdict is not None and error.upcall_id is not None:
            self._send_verdict(error.upcall_id, verdict)

    def _send_verdict(self, upcall_id: int, verdict: Verdict) -> None:
        try:
            self._sock.send(self._encode_verdict(upcall_id, verdict))
        except OSError as exc:
            self.stats.send_errors += 1
            log.error("verdict for upcall %d not sent: %s", upcall_id, exc)
            return
        self.stats.verdicts_sent += 1

    def _on_ack(self, ack: NlAck) -> None:
        pending = self._pending.get(ack.seq) if ack.seq else None
        if pending is not None:
            if pending.future.done():
                return
            if ack.errno:
                pending.future.set_exception(
                    RequestFailed(f"request {ack.seq}", ack.errno, ack.message))
            else:
                pending.future.set_result(pending.replies)
            return
        upcall_id = ack.upcall_id()
        if upcall_id is not None:
            self.stats.refused_verdicts += 1
            log.warning("verdict for upcall %d refused: %s%s", upcall_id,
                        os.strerror(ack.errno), f" ({ack.message})" if ack.message else "")
        elif ack.errno:
            log.warning("netlink error %s for request %d", os.strerror(ack.errno), ack.seq)

    def _fail(self, exc: BaseException) -> None:
        if self._loop is not None and self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        self._finish(exc)

    def _finish(self, exc: BaseException) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(ChannelError(f"channel closed: {exc}"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)


async def query_module_stats() -> Stats:
    """The module's counters on a channel of their own (vgpuctl, tests)."""
    channel = await GenlChannel.open()
    try:
        return await channel.get_stats()
    finally:
        channel.close()


async def query_module_counters() -> tuple[Stats, Stats4 | None]:
    """The module's counters, v4's too, on a channel of their own (vgpuctl)."""
    channel = await GenlChannel.open()
    try:
        return await channel.get_counters()
    finally:
        channel.close()


async def query_module_contexts() -> list[Context]:
    """The module's live contexts on a channel of their own (vgpuctl, tests)."""
    channel = await GenlChannel.open()
    try:
        return await channel.list_contexts()
    finally:
        channel.close()


def _set_rcvbuf(sock: socket.socket, size: int) -> None:
    """A large receive buffer; SO_RCVBUFFORCE passes rmem_max when privileged."""
    if os.geteuid() == 0:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
            return
        except OSError:
            pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
