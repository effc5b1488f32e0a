"""nvtrace: record what a program sends the NVIDIA driver, and check it against vgpud.

    python -m tools.nvtrace record -o DIR [--prefix P]... [--lib SO] -- CMD...
    python -m tools.nvtrace check [--json OUT] [--no-ledger] [--nvsim-src DIR] TRACE...
    python -m tools.nvtrace dump TRACE...
    python -m tools.nvtrace reissue --nodes DIR TRACE...

Run from the repository root (``-m`` puts it first on sys.path, so that tools
and vgpud are this checkout's). TRACE: a trace file (.nvtrace, .nvtrace.gz)
or a directory of them.
``check`` exits 1 when the replay check fails; ``reissue`` when an outcome
differs. See docs/nvtrace.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tools.nvtrace.check import check_traces, format_text, write_json
from tools.nvtrace.fmt import Kind, Trace, TraceError, read_trace
from tools.nvtrace.nvsim_src import DEFAULT_SRC, read_nvsim
from tools.nvtrace.reissue import reissue

# Built beside this package by tools/nvtrace/Makefile (make nvtrace).
DEFAULT_LIB = Path(__file__).resolve().parent / "libnvtrace.so"


def trace_files(args: list[str]) -> list[Path]:
    files: list[Path] = []
    for arg in args:
        p = Path(arg)
        if p.is_dir():
            files += sorted(f for f in p.iterdir()
                            if f.name.endswith((".nvtrace", ".nvtrace.gz")))
        else:
            files.append(p)
    return files


def load(args: list[str]) -> list[Trace]:
    return [read_trace(p) for p in trace_files(args)]


def record_env(out: Path, lib: Path, prefixes: list[str],
               env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that runs a command under the recorder."""
    env = dict(os.environ if env is None else env)
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib.resolve()} {preload}".strip()
    env["NVTRACE_DIR"] = str(out.resolve())
    if prefixes:
        env["NVTRACE_PREFIXES"] = ":".join(prefixes)
    return env


def cmd_record(a: argparse.Namespace) -> int:
    if not a.lib.exists():
        print(f"nvtrace: {a.lib} not built (make nvtrace)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        print("nvtrace record: no command", file=sys.stderr)
        return 2
    return subprocess.call(cmd, env=record_env(a.out, a.lib, a.prefix))


def cmd_check(a: argparse.Namespace) -> int:
    nvsim = None
    if a.nvsim_src != "none":
        try:
            nvsim = read_nvsim(Path(a.nvsim_src))
        except ValueError as exc:
            print(f"nvtrace: nvsim column unknown: {exc}", file=sys.stderr)
    res = check_traces(load(a.traces), nvsim=nvsim, ledger=not a.no_ledger)
    sys.stdout.write(format_text(res))
    if a.json:
        write_json(res, a.json)
    return 0 if res.ok else 1


def cmd_dump(a: argparse.Namespace) -> int:
    for t in load(a.traces):
        h = t.header
        print(f"{t.path}: pid {h.pid} ppid {h.ppid} flags {h.flags:#x}")
        for tag, value in h.meta:
            print(f"  meta {tag}: {value!r}")
        for r in sorted(t.records, key=lambda rec: rec.seq):
            args = " ".join(f"{x:#x}" for x in r.args)
            print(f"  #{r.seq} {Kind(r.kind).name} fd {r.fd} ret {r.ret} err {r.err} "
                  f"tid {r.tid} {r.end_ns - r.start_ns} ns args {args}")
            for b in r.blocks:
                flags = ("out " if b.out else "in ") + ("fault " if b.fault else "") + \
                        ("trunc " if b.trunc else "")
                print(f"    {b.tag} {flags}@{b.addr:#x} {len(b.data)}/{b.want}: "
                      f"{b.data[:64].hex()}")
    return 0


def cmd_reissue(a: argparse.Namespace) -> int:
    ok = True
    for t in load(a.traces):
        res = reissue(t, a.nodes)
        print(f"{t.name}: {res.compared} calls compared, {len(res.mismatches)} differ")
        for line in res.mismatches:
            print(f"  {line}")
        for what, n in sorted(res.skipped.items()):
            print(f"  skipped {n}: {what}")
        ok = ok and res.ok
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.nvtrace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="run a command under the recorder")
    rec.add_argument("-o", "--out", type=Path, required=True, help="directory for the traces")
    rec.add_argument("--prefix", action="append", default=[],
                     help="a traced path prefix (repeatable; default /dev/nvidia)")
    rec.add_argument("--lib", type=Path, default=Path(os.environ.get("NVTRACE_LIB", DEFAULT_LIB)))
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(run=cmd_record)
    chk = sub.add_parser("check", help="the replay check and its report")
    chk.add_argument("traces", nargs="+")
    chk.add_argument("--json", type=Path, help="also write the result as JSON")
    chk.add_argument("--no-ledger", action="store_true", help="skip the quota policy replay")
    chk.add_argument("--nvsim-src", default=str(DEFAULT_SRC),
                     help="kmod/nvsim sources for the nvsim column, or 'none'")
    chk.set_defaults(run=cmd_check)
    dump = sub.add_parser("dump", help="print the records")
    dump.add_argument("traces", nargs="+")
    dump.set_defaults(run=cmd_dump)
    rei = sub.add_parser("reissue", help="send the calls again and compare outcomes")
    rei.add_argument("--nodes", required=True, help="directory of nodes, e.g. /dev/nvsim")
    rei.add_argument("traces", nargs="+")
    rei.set_defaults(run=cmd_reissue)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return int(a.run(a))
    except (TraceError, OSError) as exc:
        print(f"nvtrace: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
