"""The floor of a Python responder: blocking recv, struct, ALLOW every upcall.

Not the daemon: a reference for the benchmark (tests/bench/bench_path.py),
to tell the cost of Python itself under TCG from the cost of vgpud's layers.
Uses vgpud's channel only to resolve the family, register and set the rule.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

from tests.support.policies import parse_filter_spec
from vgpud.kernel import uapi
from vgpud.kernel.channel import GenlChannel

NLMSG = struct.Struct("=IHHII")
VERDICT = struct.Struct("=IHHIIBBHHHQIIIIII")  # nlmsghdr, genlhdr, nla, vgpu_verdict


async def setup(spec: str) -> GenlChannel:
    channel = await GenlChannel.open()
    await channel.register()
    await channel.set_filter(parse_filter_spec(spec))
    return channel


def main() -> None:
    channel = asyncio.run(setup(sys.argv[1]))
    sock: socket.socket = channel._sock  # the registered port
    sock.setblocking(True)
    family = channel.family_id
    print("ready", flush=True)
    while True:
        buf = sock.recv(65536)
        _len, kind, _flags, _seq, _pid = NLMSG.unpack_from(buf)
        if kind != family or buf[16] != uapi.Cmd.UPCALL:
            continue
        upcall_id = struct.unpack_from("=Q", buf, 24)[0]  # first attr: struct vgpu_upcall
        sock.send(VERDICT.pack(VERDICT.size, family, 1, 0, 0, uapi.Cmd.VERDICT, 1, 0,
                               36, uapi.Attr.VERDICT, upcall_id, 1, 0, 0, 0, 0, 0))


if __name__ == "__main__":
    main()
