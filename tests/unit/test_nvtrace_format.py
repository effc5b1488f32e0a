"""The nvtrace format: the reader's layouts agree with gcc's reading of nvtrace.h,
and what the writer writes the reader reads back, and refuses what is broken."""

from __future__ import annotations

import gzip
import io
import shutil
import subprocess
from pathlib import Path

import pytest
from nvtrace_synth import Synth, cuda_like

from tools.nvtrace import fmt
from tools.nvtrace.fmt import Block, Header, Kind, Meta, Tag, TraceError, TraceWriter

HEADER_H = Path(__file__).resolve().parents[2] / "tools/nvtrace/nvtrace.h"

# Pinned on this side too (nvtrace.h pins them with _Static_assert).
SIZES = {"nvtrace_header": 56, "nvtrace_meta": 4, "nvtrace_record": 80, "nvtrace_block": 24}
# Constants both sides define.
CONSTANTS = {
    "NVTRACE_VERSION": fmt.VERSION, "NVTRACE_H_UNSAFE_COPY": fmt.H_UNSAFE_COPY,
    "NVTRACE_BF_OUT": fmt.BF_OUT, "NVTRACE_BF_FAULT": fmt.BF_FAULT,
    "NVTRACE_BF_TRUNC": fmt.BF_TRUNC,
    **{f"NVTRACE_{k.name}": k.value for k in fmt.Kind},
    **{f"NVTRACE_B_{t.name}": t.value for t in fmt.Tag},
    **{f"NVTRACE_M_{m.name}": m.value for m in fmt.Meta},
    **{f"NVTRACE_OPEN_{h.name}": h.value for h in fmt.OpenHow},
}


def c_values(tmp_path: Path) -> dict[str, int]:
    """sizeof/offsetof of every field, and the constants, as gcc sees them."""
    lines = [f'#include "{HEADER_H}"', "#include <stdio.h>", "#include <stddef.h>",
             "int main(void) {"]
    for lay in fmt.LAYOUTS:
        lines.append(f'printf("{lay.name} %zu\\n", sizeof(struct {lay.name}));')
        for f in lay.offsets:
            lines.append(f'printf("{lay.name}.{f} %zu\\n", offsetof(struct {lay.name}, {f}));')
    for name in CONSTANTS:
        lines.append(f'printf("{name} %llu\\n", (unsigned long long)({name}));')
    lines.append('printf("MAGIC %s\\n", NVTRACE_MAGIC); return 0; }')
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-Wall", "-Werror", "-o", exe, src], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    values = dict(line.split() for line in out.splitlines())
    assert values.pop("MAGIC").encode() + b"\0" == fmt.MAGIC
    return {k: int(v) for k, v in values.items()}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_layouts_and_constants_match_gcc(tmp_path: Path) -> None:
    py = {}
    for lay in fmt.LAYOUTS:
        py[lay.name] = lay.size
        py.update({f"{lay.name}.{f}": off for f, off in lay.offsets.items()})
    assert c_values(tmp_path) == {**py, **CONSTANTS}


def test_sizes_pinned() -> None:
    assert {lay.name: lay.size for lay in fmt.LAYOUTS} == SIZES


def sample() -> bytes:
    out = io.BytesIO()
    w = TraceWriter(out, Header(77, 1, 5, 6, 0, 4096, 64,
                                ((Meta.DRIVER, "NVRM x"), (Meta.GPU, "A"), (Meta.GPU, "B"),
                                 (Meta.CMDLINE, "prog\0-v"))))
    w.write(Kind.OPEN, 3, ret=3, blocks=[Block(Tag.PATH, False, 0, 15, b"/dev/nvidiactl\0"[:15])])
    w.write(Kind.IOCTL, 3, ret=-1, err=22, args=(0xC020462B, 0x1000), tid=9,
            blocks=[Block(Tag.ARG, False, 0x1000, 32, bytes(range(32))),
                    Block(Tag.PTR, True, 0x2000, 9, b"abc", fault=True, err=14),
                    Block(Tag.XFER, False, 0x3000, 1 << 20, b"x" * 5, trunc=True)])
    w.write(Kind.CLOSE, 3)
    return out.getvalue()


def test_round_trip() -> None:
    t = fmt.parse(sample())
    h = t.header
    assert (h.pid, h.ppid, h.realtime_ns, h.monotonic_ns, h.max_block, h.window) == \
        (77, 1, 5, 6, 4096, 64)
    assert h.value(Meta.DRIVER) == "NVRM x"
    assert h.values(Meta.GPU) == ["A", "B"]
    assert h.cmdline == ["prog", "-v"]
    assert [r.kind for r in t.records] == [Kind.OPEN, Kind.IOCTL, Kind.CLOSE]
    r = t.records[1]
    assert (r.seq, r.fd, r.ret, r.err, r.tid, r.args) == (1, 3, -1, 22, 9, (0xC020462B, 0x1000,
                                                                            0, 0))
    arg, ptr, xfer = r.blocks
    assert arg.whole and arg.data == bytes(range(32)) and not arg.out
    assert ptr.out and ptr.fault and ptr.err == 14 and ptr.data == b"abc" and not ptr.whole
    assert xfer.trunc and not xfer.whole and xfer.want == 1 << 20
    assert r.block(Tag.PTR, out=True) is ptr and r.block(Tag.PTR) is None
    assert t.tail == 0


def test_gzip(tmp_path: Path) -> None:
    plain, packed = tmp_path / "a.nvtrace", tmp_path / "a.nvtrace.gz"
    plain.write_bytes(sample())
    packed.write_bytes(gzip.compress(sample()))
    assert fmt.read_trace(packed).records == fmt.read_trace(plain).records
    (tmp_path / "b.nvtrace.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="gzip"):
        fmt.read_trace(tmp_path / "b.nvtrace.gz")


def test_incomplete_tail_is_reported_not_fatal() -> None:
    data = sample()
    t = fmt.parse(data[:-10])
    assert len(t.records) == 2 and t.tail > 0
    assert fmt.parse(data[:-fmt.RECORD.size - 3]).tail > 0


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda b: b"NOTTRACE" + b[8:], "magic"),
    (lambda b: b[:8] + b"\x03\x00" + b[10:], "version 3"),
    (lambda b: b[:12] + b"\x03\x00\x00\x00" + b[16:], "meta_size"),
    (lambda b: b[:20], "magic"),
])
def test_bad_header(mutate, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        fmt.parse(mutate(sample()))


def test_bad_record_and_block_sizes() -> None:
    data = bytearray(sample())
    start = fmt.HEADER.size + int.from_bytes(data[12:16], "little")
    bad = bytearray(data)
    bad[start:start + 4] = (12).to_bytes(4, "little")  # not a multiple of 8, below the header
    with pytest.raises(TraceError, match="bad size"):
        fmt.parse(bytes(bad))
    bad = bytearray(data)
    blk = start + fmt.RECORD.size
    bad[blk + 4:blk + 8] = (4096).to_bytes(4, "little")  # the path block runs past its record
    with pytest.raises(TraceError, match="runs past"):
        fmt.parse(bytes(bad))


def test_synthetic_trace_reads() -> None:
    s = Synth()
    cuda_like(s)
    t = s.trace()
    assert len(t.records) == 20
    assert [r.seq for r in t.records] == list(range(20))
