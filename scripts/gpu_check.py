"""Helpers of scripts/gpu-check: the machine's facts, and the one-screen summary.

    python3 scripts/gpu_check.py facts OUT/facts.json
    python3 scripts/gpu_check.py merge OUT/check.json NAME=FILE.json...
    python3 scripts/gpu_check.py summary OUT WORK/steps.tsv   (writes OUT/summary.txt)

Standard library only (nvidia-ml-py when present): it runs on a GPU machine
with nothing installed. Every probe is guarded: a fact that cannot be read
is recorded as {"error": ...}, never a crash.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAP_SYS_MODULE = 16


def read(path: str, first_line: bool = False) -> str | None:
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if first_line and text else text


def run(*cmd: str, timeout: float = 30) -> dict[str, Any]:
    if shutil.which(cmd[0]) is None:
        return {"error": f"{cmd[0]} not found"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return {"rc": r.returncode, "out": r.stdout.strip()[:4000], "err": r.stderr.strip()[:1000]}


def guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # a fact we cannot read is a fact too
        return {"error": f"{type(exc).__name__}: {exc}"}


def nodes() -> list[dict[str, Any]]:
    paths = sorted(Path("/dev").glob("nvidia*")) + sorted(Path("/dev/nvidia-caps").glob("*"))
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            st = p.stat()
        except OSError as exc:
            out.append({"path": str(p), "error": str(exc)})
            continue
        kind = "char" if stat.S_ISCHR(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else \
            "other"
        out.append({"path": str(p), "type": kind, "major": os.major(st.st_rdev),
                    "minor": os.minor(st.st_rdev), "mode": oct(stat.S_IMODE(st.st_mode)),
                    "uid": st.st_uid, "gid": st.st_gid})
    return out


def cap_sys_module() -> bool | None:
    status = read("/proc/self/status") or ""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_MODULE & 1)
    return None


def modules() -> dict[str, Any]:
    release = platform.release()
    build = Path(f"/lib/modules/{release}/build")
    proc_modules = read("/proc/modules")
    sysmod = Path("/sys/module/nvidia")
    info: dict[str, Any] = {
        "modules_disabled": read("/proc/sys/kernel/modules_disabled"),
        "proc_modules": proc_modules is not None,
        "nvidia_in_proc_modules": bool(proc_modules and any(
            line.split()[0] == "nvidia" for line in proc_modules.splitlines())),
        "sys_module_nvidia": sysmod.exists(),
        # A loadable module has initstate and refcnt; a built-in one does not.
        "nvidia_initstate": read(str(sysmod / "initstate")),
        "nvidia_refcnt": read(str(sysmod / "refcnt")),
        "modinfo_nvidia": run("modinfo", "-n", "nvidia"),
        "build_dir": str(build) if build.exists() else None,
        "cap_sys_module": cap_sys_module(),
        "cc": shutil.which("cc") or shutil.which("gcc"),
    }
    why = []
    if info["modules_disabled"] != "0":
        why.append(f"/proc/sys/kernel/modules_disabled: {info['modules_disabled'] or 'absent'}")
    if not info["proc_modules"]:
        why.append("no /proc/modules (no loadable modules, or a sandbox such as gVisor)")
    if not info["cap_sys_module"]:
        why.append("no CAP_SYS_MODULE")
    if info["build_dir"] is None:
        why.append(f"no kernel build directory for {release}")
    if not info["cc"]:
        why.append("no C compiler")
    info["can_build_and_load"] = not why
    info["why_not"] = why
    return info


def nvml_device(nvml: Any, i: int) -> dict[str, Any]:
    h = nvml.nvmlDeviceGetHandleByIndex(i)

    def text(v: Any) -> Any:
        return v.decode(errors="replace") if isinstance(v, bytes) else v

    mem = guard(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
    return {
        "index": i,
        "name": guard(lambda: text(nvml.nvmlDeviceGetName(h))),
        "uuid": guard(lambda: text(nvml.nvmlDeviceGetUUID(h))),
        "pci_bus_id": guard(lambda: text(nvml.nvmlDeviceGetPciInfo(h).busId)),
        "memory": mem if isinstance(mem, dict) else
        {"total": mem.total, "free": mem.free, "used": mem.used},
        "mig_mode": guard(lambda: list(nvml.nvmlDeviceGetMigMode(h))),
        "accounting_mode": guard(lambda: nvml.nvmlDeviceGetAccountingMode(h)),
        "compute_mode": guard(lambda: nvml.nvmlDeviceGetComputeMode(h)),
        "persistence_mode": guard(lambda: nvml.nvmlDeviceGetPersistenceMode(h)),
        "process_utilization": guard(lambda: [
            {"pid": s.pid, "sm": s.smUtil, "mem": s.memUtil}
            for s in nvml.nvmlDeviceGetProcessUtilization(h, 0)]),
        "compute_processes": guard(lambda: [
            {"pid": p.pid, "used": p.usedGpuMemory}
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)]),
    }


def nvml_facts() -> dict[str, Any]:
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        return {"error": f"nvidia-ml-py not installed: {exc}"}
    from tools.nvtrace.vgpud_api import nvml_inventory

    out: dict[str, Any] = {"inventory": guard(nvml_inventory)}
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        out["error"] = f"nvmlInit: {exc}"
        return out
    try:
        out["driver"] = guard(nvml.nvmlSystemGetDriverVersion)
        out["cuda_driver"] = guard(nvml.nvmlSystemGetCudaDriverVersion)
        out["devices"] = [nvml_device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
    finally:
        guard(nvml.nvmlShutdown)
    return out


def _version(module: str) -> str:
    return str(__import__(module).__dict__.get("__version__", "present"))


def python_facts() -> dict[str, Any]:
    have: dict[str, Any] = {}
    for name in ("torch", "pynvml", "pydantic", "dbus_fast", "uvloop", "click"):
        have[name] = guard(partial(_version, name))
    return {"version": sys.version.split()[0], "executable": sys.executable, "modules": have}


def facts() -> dict[str, Any]:
    smi = "--query-gpu=name,driver_version,memory.total,mig.mode.current,uuid"
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "uname": " ".join(platform.uname()),
        "proc_version": read("/proc/version"),
        "driver_proc": read("/proc/driver/nvidia/version", first_line=True),
        "driver_sys_module": read("/sys/module/nvidia/version"),
        "nvidia_smi": run("nvidia-smi", smi, "--format=csv,noheader"),
        "modules": guard(modules),
        "nodes": guard(nodes),
        "nvml": guard(nvml_facts),
        "python": guard(python_facts),
    }


def cmd_facts(out: Path) -> int:
    out.write_text(json.dumps(facts(), indent=1, default=str) + "\n")
    return 0


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def cmd_merge(out: Path, parts: list[str]) -> int:
    merged: dict[str, Any] = {}
    for part in parts:
        name, _, path = part.partition("=")
        merged[name] = guard(partial(_load, Path(path)))
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


# --- the summary -------------------------------------------------------------


def _node_line(facts: dict[str, Any]) -> str:
    nodes_ = facts.get("nodes")
    if not isinstance(nodes_, list) or not nodes_:
        return "nodes: none under /dev/nvidia*"
    return "nodes: " + ", ".join(
        f"{n['path'].removeprefix('/dev/')} {n.get('major')}:{n.get('minor')} {n.get('mode')}"
        for n in nodes_[:8]) + (" ..." if len(nodes_) > 8 else "")


def _gpu_lines(facts: dict[str, Any]) -> list[str]:
    nvml = facts.get("nvml") or {}
    lines = [f"NVML: driver {nvml.get('driver', '-')} cuda {nvml.get('cuda_driver', '-')}; "
             f"vgpud inventory {nvml.get('inventory', '-')}"
             + (f"; {nvml['error']}" if "error" in nvml else "")]
    for d in nvml.get("devices") or []:
        mem = d.get("memory") or {}
        util = str(d.get("process_utilization"))[:40]
        lines.append(f"  GPU {d['index']} {d.get('name')} {d.get('uuid')} mem "
                     f"{mem.get('total', '?')} MIG {d.get('mig_mode')} accounting "
                     f"{d.get('accounting_mode')} procutil {util}")
    return lines


def _fact_lines(facts: dict[str, Any]) -> list[str]:
    mods = facts.get("modules") or {}
    py = (facts.get("python") or {}).get("modules") or {}
    missing = [k for k, v in py.items() if isinstance(v, dict)]
    smi = facts.get("nvidia_smi") or {}
    return [
        f"driver: {facts.get('driver_proc') or smi.get('out') or smi.get('error') or '-'}",
        f"kernel: {facts.get('uname')}",
        f"modules: build+load {'yes' if mods.get('can_build_and_load') else 'no'}"
        f" ({'; '.join(mods.get('why_not') or []) or 'ok'}); nvidia in /proc/modules: "
        f"{mods.get('nvidia_in_proc_modules')}, initstate {mods.get('nvidia_initstate')}",
        _node_line(facts),
        *_gpu_lines(facts),
        f"python {(facts.get('python') or {}).get('version')}: missing {missing or 'nothing'}",
    ]


def _check_lines(check: dict[str, Any]) -> list[str]:
    lines = []
    for name, res in check.items():
        if name.startswith("probe-"):
            lines.append(f"{name.removeprefix('probe-')} program: {json.dumps(res)}"[:400])
            continue
        if not isinstance(res, dict) or "calls" not in res:
            lines.append(f"check {name}: no result ({res})"[:120])
            continue
        led = res.get("ledger_skipped") or "; ".join(
            f"held {lr['held_end']} ledger {lr['ledger_end']}" for lr in res.get("ledger") or [])
        lines.append(f"check {name}: {'PASS' if res['ok'] else 'FAIL'} {res['calls']} calls, "
                     f"{res['decoded']} decoded, {sum(res['unknown'].values())} not decoded, "
                     f"{len(res['findings'])} findings; ledger: {led}"[:160])
        lines += [f"    {f}"[:120] for f in res["findings"][:3]]
    return lines


def summary(out: Path, steps: Path) -> int:
    facts = guard(lambda: json.loads((out / "facts.json").read_text()))
    facts = facts if "error" not in facts else {}
    check = guard(lambda: json.loads((out / "check.json").read_text()))
    rows = [line.split("\t") for line in steps.read_text().splitlines() if line]
    dry = any(r[0] == "dry" for r in rows)
    head = "gpu-check " + time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    lines = [head + ("  DRY RUN: no NVIDIA GPU here" if dry else ""), *_fact_lines(facts),
             "steps:"]
    lines += [f"  {r[0]:<16} {r[1]:<5} {r[2]:>6} s  {r[3] if len(r) > 3 else ''}"[:120]
              for r in rows if r[0] != "dry"]
    lines += _check_lines(check if "error" not in check else {})
    quota = (read(str(out / "quota.txt")) or "-").splitlines()
    lines += [f"quota: {line}"[:160] for line in quota if not line.startswith("{")][:4]
    lines += [f"quota program: {line}"[:200] for line in quota if line.startswith("{")][:1]
    lines.append(f"output: {out}")
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "facts":
        sys.exit(cmd_facts(Path(rest[0])))
    if what == "merge":
        sys.exit(cmd_merge(Path(rest[0]), rest[1:]))
    if what == "summary":
        sys.exit(summary(Path(rest[0]), Path(rest[1])))
    sys.exit(f"usage: {__doc__}")
