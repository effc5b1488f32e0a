"""The rules HACKING.md says must never break, checked on what Python loads.

Each check imports the package in a fresh interpreter and looks at sys.modules,
so an import hidden in a dependency counts as much as one written here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest

VGPUD = Path(__file__).resolve().parents[2] / "vgpud"
# Modules that do I/O of their own (event loops, processes, buses, kernels).
IO_MODULES = ("asyncio", "subprocess", "dbus_fast", "bcc", "pynvml", "mfusepy")
# vgpud's rooms with sockets, files or the clock.
IO_ROOMS = ("vgpud.store", "vgpud.host", "vgpud.sched", "vgpud.admin", "vgpud.app",
            "vgpud.daemon", "vgpud.kernel.channel", "vgpud.probes.bcc_probes",
            "vgpud.probes.service")


def loaded_after(*modules: str) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return set(json.loads(out))


def offenders(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


SANS_IO = [
    "vgpud.core.tenants", "vgpud.core.ledger", "vgpud.core.tdma", "vgpud.core.groups",
    "vgpud.core.shares", "vgpud.core.observers", "vgpud.core.runlist", "vgpud.nvidia.layouts",
    "vgpud.kernel.codec", "vgpud.policy.dispatch", "vgpud.policy.quota",
    "vgpud.policy.sched", "vgpud.policy.events", "vgpud.policy.rules",
    "vgpud.probes.histograms", "vgpud.probes.layout", "vgpud.probes.render",
    "vgpud.fsview.snapshot", "vgpud.fsview.render", "vgpud.fsview.values",
    "vgpud.metrics.snapshot", "vgpud.metrics.families", "vgpud.metrics.listen",
    "vgpud.metrics.wire", "vgpud.wire", "vgpud.probes.wire",
    "vgpud.cdi.spec", "vgpud.cdi.hook",
]


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_rooms_load_no_io(module: str) -> None:
    loaded = loaded_after(module)
    assert offenders(loaded, IO_MODULES + IO_ROOMS) == []


def test_core_imports_nothing_of_vgpud_but_core() -> None:
    loaded = loaded_after(*(m for m in SANS_IO if m.startswith("vgpud.core.")))
    assert sorted(m for m in loaded if m.startswith("vgpud.")
                  and not m.startswith("vgpud.core")) == []


def test_cli_reaches_the_daemon_only_over_dbus() -> None:
    """vgpuctl is a D-Bus client; of the kernel side it loads only the netlink
    query that module-stats/module-contexts need (they work with the daemon down)."""
    loaded = loaded_after("vgpud.cli")
    assert offenders(loaded, ("vgpud.policy", "vgpud.core.ledger", "vgpud.core.tdma",
                              "vgpud.store", "vgpud.sched", "vgpud.app", "vgpud.daemon",
                              "vgpud.admin.manager", "vgpud.admin.dbus",
                              "vgpud.probes.bcc_probes", "vgpud.probes.service")) == []


def module_name(path: Path) -> str:
    parts = path.relative_to(VGPUD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The vgpud names a file imports, under TYPE_CHECKING and inside
    functions too (what a reader follows, not only what Python loads):
    ``from vgpud.a import b`` names vgpud.a and vgpud.a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "vgpud" or n.startswith("vgpud.")}


def imported_by(room: str) -> dict[str, set[str]]:
    """vgpud module -> the vgpud names its source imports, for a room's files."""
    return {module_name(path): imports_of(path) for path in sorted((VGPUD / room).rglob("*.py"))}


# Rooms that decide, and the rooms above them they must not know of: deciding
# never calls, waits on or types against the admin side (vgpud.app wires the
# policy's events to it), the store, the host or the adapters.
ABOVE_DECIDING = ("vgpud.admin", "vgpud.app", "vgpud.daemon", "vgpud.sched", "vgpud.store",
                  "vgpud.host", "vgpud.metrics", "vgpud.fsview", "vgpud.cdi", "vgpud.probes",
                  "vgpud.cli", "vgpud.kernel.channel")


@pytest.mark.parametrize("room", ["policy", "core", "nvidia"])
def test_deciding_never_imports_the_rooms_above_it(room: str) -> None:
    wrong = {module: sorted(offenders(names, ABOVE_DECIDING))
             for module, names in imported_by(room).items()}
    assert {m: names for m, names in wrong.items() if names} == {}


def production_entries() -> set[str]:
    """The modules the package's console scripts start in, and the CDI hook
    (run by container runtimes as ``python -m vgpud.cdi.hook``)."""
    scripts = tomllib.loads((VGPUD.parent / "pyproject.toml").read_text())["project"]["scripts"]
    return {target.partition(":")[0] for target in scripts.values()} | {"vgpud.cdi.hook"}


def test_every_module_ships_for_production() -> None:
    """Nothing under vgpud/ is there for the tests alone: each module is
    imported, directly or not, from a production entry point."""
    graph = {module_name(path): imports_of(path) for path in VGPUD.rglob("*.py")}
    reached: set[str] = set()
    todo = sorted(production_entries())
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        # A module's packages load with it.
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += [n for n in (*graph[module], *parents) if n in graph]
    assert sorted(m for m in graph if m not in reached) == []


# Public functions the tests reach that vgpud never names. Each says why it stays;
# keep this short: a name here is production code only tests call.
TEST_ONLY_ALLOWED = {
    "init": "vgpud.fsview.ops.FileView: mfusepy calls its Operations by name",
    "tick": "the cores' documented shorthand for handle(Tick(), now); the daemon sends Tick",
    "frame_end_us": "vgpud.core.tdma: a view of the frame only tests read (to remove)",
    "lat_call": "vgpud.probes.layout: the latency map's key, as the BPF side builds it",
    "query_module_stats": "vgpud.kernel.channel: the module's counters, for the VM tests",
}


def names_used(paths: Iterable[Path]) -> set[str]:
    """Every name read or written, attribute or imported in ``paths``: a loose
    match (any object's ``x.run`` counts for every ``def run``)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.name.rpartition(".")[2])
    return names


def public_defs() -> dict[str, list[str]]:
    """Public function and method names defined under vgpud/ -> where. Left
    out: those a called decorator registers (click commands, D-Bus members),
    which their framework calls by name."""
    defs: dict[str, list[str]] = {}
    for path in sorted(VGPUD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not node.name.startswith("_")
                    and not any(isinstance(d, ast.Call) for d in node.decorator_list)):
                where = f"{path.relative_to(VGPUD.parent)}:{node.lineno}"
                defs.setdefault(node.name, []).append(where)
    return defs


def test_no_public_function_is_there_for_the_tests_alone() -> None:
    """A function or method defined under vgpud/ that the tests call is named
    somewhere in vgpud/ (or tools/, or is an entry point) too. A name scan: it
    misses a test-only method that shares its name with anything vgpud names."""
    root = VGPUD.parent
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    production = (names_used(VGPUD.rglob("*.py")) | names_used((root / "tools").rglob("*.py"))
                  | {target.partition(":")[2] for target in scripts.values()})
    tested = names_used((root / "tests").rglob("*.py"))
    test_only = {name: where for name, where in public_defs().items()
                 if name in tested and name not in production}
    assert {n: w for n, w in test_only.items() if n not in TEST_ONLY_ALLOWED} == {}
    assert sorted(n for n in TEST_ONLY_ALLOWED if n not in test_only) == []  # no stale entry
