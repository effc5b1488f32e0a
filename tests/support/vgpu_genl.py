"""vgpu's generic netlink family spoken raw, for the module tests: the uapi
constants and structs (kmod/include/uapi/linux/vgpu.h) written out again here,
so that a change on one side shows up, and a small blocking client that
plays the daemon (register, filter, verdicts) or sends malformed requests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator

from vgpud.kernel import uapi

NETLINK_GENERIC = 16
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x100, 0x200
SOL_NETLINK, NETLINK_EXT_ACK = 270, 11
GENL_ID_CTRL, CTRL_CMD_GETFAMILY = 0x10, 3
CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 1, 2

(CMD_REGISTER, CMD_SET_FILTER, CMD_GET_STATS, CMD_UPCALL, CMD_VERDICT, CMD_EVENT,
 CMD_UNREGISTER) = range(1, 8)
(A_VERSION, A_FILTER_FLAGS, A_RULES, A_STATS, A_UPCALL, A_PARAMS, A_DATA, A_CGROUP,
 A_VERDICT, A_EVENT) = range(1, 11)
NODE_CTL, NODE_GPU, NODE_UVM = 0, 1, 2
OFF_NONE = 0xFFFFFFFF
FILTER_OPEN, FILTER_UVM_MMAP = 1, 2
UPCALL_OPEN, UPCALL_IOCTL, UPCALL_POST, UPCALL_MMAP = 1, 2, 3, 4
F_XFER, F_DATA_FAULT, F_DATA_BIG = 1, 2, 4
F_DATA2_FAULT, F_DATA2_BIG = 8, 16
A_NESTED, A_DATA2 = 18, 19
NESTED = struct.Struct("=6I")  # struct vgpu_rule_nested
NESTED_MAX = 256
ALLOW, DENY, FAIL_STATUS, REPLY = 1, 2, 3, 4
VERDICT_F_POST = 1
EVENT_POST, EVENT_CLOSE = 1, 2
PROTO_VERSION = uapi.PROTO_VERSION  # the header's, through the mirror the host tier pins

RULE = struct.Struct("=8I32I")
UPCALL = struct.Struct("=3Q12IiI")
VERDICT = struct.Struct("=QIIIIII")
MMAP_PARAMS = struct.Struct("=QQII")
# Indices in UPCALL.unpack(): the fields the tests look at.
U_ID, U_KIND, U_NODE, U_NR, U_FLAGS, U_RET = 0, 3, 4, 7, 8, 15
EVENT = struct.Struct("=QQIIiI")
STATS_FIELDS = (
    "version", "daemon_portid", "contexts", "opens", "ioctls", "upcalls", "verdicts",
    "timeouts", "lost", "fail_open", "fail_closed", "killed", "events", "events_lost",
    "bad_verdicts", "mmaps",
)
STATS = struct.Struct("=II14Q")
A_STATS4 = 22
STATS4_FIELDS = ("abandoned", "revoked", "tampered", "throttled", "proxies", "objects")
STATS4 = struct.Struct("=8Q")


def rule(nodes: int, nr: int, size: int = 0, match_off: int = OFF_NONE,
         keys: tuple[int, ...] = (), ptr_off: int = OFF_NONE, len_off: int = OFF_NONE,
         flags: int = 0, n_match: int | None = None) -> bytes:
    match = list(keys) + [0] * (32 - len(keys))
    n = len(keys) if n_match is None else n_match
    return RULE.pack(nodes, nr, size, match_off, ptr_off, len_off, n, flags, *match)

CTL = 1 << NODE_CTL


def nested(rule_index: int, ptr_off: int, count_off: int, elem_size: int, max_count: int,
           reserved: int = 0) -> bytes:
    return NESTED.pack(rule_index, ptr_off, count_off, elem_size, max_count, reserved)


def nla(t: int, data: bytes) -> bytes:
    pad = (4 - len(data) % 4) % 4
    return struct.pack("=HH", 4 + len(data), t) + data + b"\0" * pad


def parse_attrs(data: bytes) -> dict[int, bytes]:
    attrs, off = {}, 0
    while off + 4 <= len(data):
        ln, ty = struct.unpack_from("=HH", data, off)
        if ln < 4:
            break
        attrs[ty & 0x3FFF] = data[off + 4:off + ln]
        off += (ln + 3) & ~3
    return attrs


class NlError(OSError):
    def __init__(self, err: int, msg: str) -> None:
        super().__init__(err, f"{os.strerror(err)}: {msg}")
        self.msg = msg


class Genl:
    """vgpu's family over a raw socket; upcalls/events queue up in .pending."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        self.sock.bind((0, 0))
        self.seq = 0
        self.pending: list[tuple[int, dict[int, bytes]]] = []
        self.family = GENL_ID_CTRL
        _, replies = self.request(CTRL_CMD_GETFAMILY,
                                  [(CTRL_ATTR_FAMILY_NAME, b"vgpu\0")], version=1)
        self.family = struct.unpack("=H", replies[0][CTRL_ATTR_FAMILY_ID][:2])[0]

    def close(self) -> None:
        self.sock.close()

    def send(self, cmd: int, attrs: list[tuple[int, bytes]], flags: int = NLM_F_ACK,
             version: int = 1) -> int:
        self.seq += 1
        body = struct.pack("=BBH", cmd, version, 0) + b"".join(nla(t, d) for t, d in attrs)
        self.sock.send(struct.pack("=IHHII", 16 + len(body), self.family,
                                   NLM_F_REQUEST | flags, self.seq, 0) + body)
        return self.seq

    def recv(self, timeout: float | None) -> list[tuple[int, int, int, bytes]]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(1 << 16)
        msgs, off = [], 0
        while off + 16 <= len(data):
            ln, ty, fl, seq, _ = struct.unpack_from("=IHHII", data, off)
            msgs.append((ty, fl, seq, data[off + 16:off + ln]))
            off += (ln + 3) & ~3
        return msgs

    def request(self, cmd: int, attrs: list[tuple[int, bytes]],
                version: int = 1) -> tuple[int, list[dict[int, bytes]]]:
        seq = self.send(cmd, attrs, version=version)
        replies: list[dict[int, bytes]] = []
        while True:
            for ty, fl, mseq, body in self.recv(10):
                if ty == NLMSG_ERROR and mseq == seq:
                    err = -struct.unpack_from("=i", body)[0]
                    msg = ""
                    if fl & NLM_F_ACK_TLVS:
                        olen = 16 if fl & NLM_F_CAPPED else struct.unpack_from("=I", body, 4)[0]
                        tlv = parse_attrs(body[4 + ((olen + 3) & ~3):])
                        msg = tlv.get(1, b"").rstrip(b"\0").decode()
                    if err:
                        raise NlError(err, msg)
                    return 0, replies
                if mseq == seq:
                    replies.append(parse_attrs(body[4:]))
                elif ty == self.family:
                    self.pending.append((body[0], parse_attrs(body[4:])))

    def next_msg(self, cmd: int, timeout: float = 10) -> dict[int, bytes]:
        deadline = time.monotonic() + timeout
        while True:
            for i, (c, attrs) in enumerate(self.pending):
                if c == cmd:
                    del self.pending[i]
                    return attrs
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message {cmd}")
            try:
                msgs = self.recv(left)
            except TimeoutError:
                continue
            for ty, _, _, body in msgs:
                if ty == self.family:
                    self.pending.append((body[0], parse_attrs(body[4:])))

    def next_upcall(self, timeout: float = 10) -> tuple[tuple[int, ...], dict[int, bytes]]:
        attrs = self.next_msg(CMD_UPCALL, timeout)
        return UPCALL.unpack(attrs[A_UPCALL]), attrs

    def register(self, version: int = PROTO_VERSION) -> None:
        self.request(CMD_REGISTER, [(A_VERSION, struct.pack("=I", version))])

    def unregister(self) -> None:
        self.request(CMD_UNREGISTER, [])

    def set_filter(self, rules: list[bytes], flags: int = 0, raw: bytes | None = None,
                   nests: list[bytes] | None = None) -> None:
        data = b"".join(rules) if raw is None else raw
        attrs = [(A_FILTER_FLAGS, struct.pack("=I", flags)), (A_RULES, data)]
        if nests is not None:
            attrs.append((A_NESTED, b"".join(nests)))
        self.request(CMD_SET_FILTER, attrs)

    def verdict(self, uid: int, action: int, error: int = 0, status: int = 0,
                status_off: int = 0, flags: int = 0, reserved: int = 0,
                params: bytes | None = None, data: bytes | None = None,
                data2: bytes | None = None) -> None:
        attrs = [(A_VERDICT, VERDICT.pack(uid, action, error, status, status_off, flags,
                                          reserved))]
        if params is not None:
            attrs.append((A_PARAMS, params))
        if data is not None:
            attrs.append((A_DATA, data))
        if data2 is not None:
            attrs.append((A_DATA2, data2))
        self.request(CMD_VERDICT, attrs)

    def stats(self) -> dict[str, int]:
        _, replies = self.request(CMD_GET_STATS, [])
        out = dict(zip(STATS_FIELDS, STATS.unpack(replies[0][A_STATS]), strict=True))
        raw4 = replies[0].get(A_STATS4)
        if raw4 is not None:  # VGPU_A_STATS4: absent from a module that predates it
            out |= dict(zip(STATS4_FIELDS, STATS4.unpack(raw4)[:6], strict=True))
        return out


def stats() -> dict[str, int]:
    g = Genl()
    try:
        return g.stats()
    finally:
        g.close()


def set_filter(rules: list[bytes], flags: int = 0) -> None:
    """Install a filter as a daemon would (SET_FILTER is the registered port's
    only); it stays when this client's port goes."""
    g = Genl()
    try:
        g.register()
        g.set_filter(rules, flags)
    finally:
        g.close()


@contextlib.contextmanager
def daemon(rules: list[bytes], flags: int = 0,
           nests: list[bytes] | None = None) -> Iterator[Genl]:
    """A registered client with `rules` (and their nested lists) as the filter:
    the daemon, for a test."""
    g = Genl()
    try:
        g.register()
        g.set_filter(rules, flags, nests=nests)
        yield g
    finally:
        g.close()
