"""vgpuctl: the command-line front end.

A thin client of vgpud's D-Bus API (org.vgpud1 on the system bus, see
docs/dbus-api.md), plus ``module-stats`` and ``module-contexts``, which ask the
kernel module directly.
Read commands take --json (one JSON document on stdout).

Exit status, for scripts:
   0  ok
   1  the daemon refused the request (NoSuchTenant, InvalidArgument, ...)
   2  usage error (bad options or arguments)
  69  EX_UNAVAILABLE: vgpud is not running / the module is absent
  77  EX_NOPERM: permission denied (not root nor in the admin group)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from dbus_fast import DBusError, Variant
from rich.console import Console
from rich.live import Live
from rich.table import Table

from vgpud.admin.client import AdminClient, DaemonUnavailable
from vgpud.cdi.files import SpecFile, this_hook
from vgpud.cdi.hook import (
    MAX_STATE_BYTES,
    cgroup_line,
    cgroup_v2_path,
    container_pid,
    container_state,
    record_name,
    within,
)
from vgpud.cdi.spec import build_spec, render
from vgpud.kernel import uapi
from vgpud.kernel.channel import ChannelError, query_module_contexts, query_module_counters
from vgpud.kernel.codec import DecodeError
from vgpud.probes.histograms import Histogram
from vgpud.probes.render import by_histogram, log2_lines, summary

__all__ = ["main"]

T = TypeVar("T")

EX_ERROR = 1
EX_UNAVAILABLE = 69
EX_NOPERM = 77
_NOPERM_ERRORS = frozenset({
    "org.vgpud1.Error.PermissionDenied",
    "org.freedesktop.DBus.Error.AccessDenied",  # refused by the bus policy
})
U32 = click.IntRange(0, 2**32 - 1)
PROC = Path("/proc")
# What `cdi bind` bound, by container id, for `cdi unbind` at poststop (the
# container's process is gone by then). Root's, in /run: gone at reboot,
# with the bindings it names (cgroup ids do not survive one).
CDI_RECORDS = Path("/run/vgpud-cdi")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and control vgpud and the vgpu kernel module."""


@main.command("module-stats")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def module_stats(as_json: bool) -> None:
    """The vgpu module's counters (VGPU_CMD_GET_STATS): struct vgpu_stats, then
    struct vgpu_stats4 (abandoned, throttled, ...) from a module that sends it."""
    try:
        stats, stats4 = asyncio.run(query_module_counters())
    except (ChannelError, DecodeError) as exc:
        click.echo(f"vgpuctl: {exc}", err=True)
        raise SystemExit(EX_UNAVAILABLE) from None
    counters = asdict(stats) | (asdict(stats4) if stats4 is not None else {})
    if as_json:
        click.echo(json.dumps(counters))
        return
    table = Table("counter", "value", title="vgpu module")
    for name, value in counters.items():
        table.add_row(name, str(value))
    Console().print(table)


@main.command("module-contexts")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")
def module_contexts(as_json: bool) -> None:
    """The vgpu module's open emulated files (VGPU_CMD_LIST_CONTEXTS)."""
    try:
        contexts = asyncio.run(query_module_contexts())
    except (ChannelError, DecodeError) as exc:
        click.echo(f"vgpuctl: {exc}", err=True)
        raise SystemExit(EX_UNAVAILABLE) from None
    rows = [c._asdict() | {"node": c.node.name.lower()} for c in contexts]
    if as_json:
        click.echo(json.dumps(rows))
        return
    table = Table(*uapi.Context._fields, title="vgpu module contexts")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)


# --- talking to vgpud ---


def _fail(message: str, status: int) -> NoReturn:
    click.echo(f"vgpuctl: {message}", err=True)
    raise SystemExit(status)


def _daemon(action: Callable[[AdminClient], Awaitable[T]]) -> T:
    """Run `action` against vgpud; daemon errors become exit statuses."""

    try:
        return asyncio.run(AdminClient.run(action))
    except DaemonUnavailable as e:
        _fail(str(e), EX_UNAVAILABLE)
    except DBusError as e:
        name = e.type.rpartition(".")[2]
        _fail(f"{e.text} ({name})", EX_NOPERM if e.type in _NOPERM_ERRORS else EX_ERROR)


def _call(member: str, signature: str = "", *body: Any) -> Any:
    return _daemon(lambda client: client.call(member, signature, *body))


def _snake(properties: dict[str, Any]) -> dict[str, Any]:
    """D-Bus property names as JSON keys: MemoryLimitBytes -> memory_limit_bytes."""
    return {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower(): v for k, v in properties.items()}


def _gpus(rows: list[list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(("index", "name", "total", "used"), row, strict=True)) for row in rows]


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _echo_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2))


def _gpu_table(gpus: list[dict[str, Any]]) -> Table:
    table = Table("GPU", "NAME", "MEMORY", "ALLOCATED", title="GPUs")
    for gpu in gpus:
        table.add_row(str(gpu["index"]), gpu["name"], _size(gpu["total"]), _size(gpu["used"]))
    return table


def _tenant_table(tenants: list[dict[str, Any]]) -> Table:
    table = Table("TENANT", "LIMIT", "USED / LIMIT PER GPU", "CONTEXTS", "WEIGHT", "CAP",
                  "PRIORITY", title="tenants")
    for t in tenants:
        usage = "\n".join(
            f"{gpu}: {_size(t['memory_used'].get(gpu, 0))} / {_size(t['memory_limit_bytes'][gpu])}"
            for gpu in t["gpus"]
        )
        table.add_row(
            t["name"], t["memory_limit"] or "device", usage or "-", str(t["contexts"]),
            str(t["weight"]), f"{t['cap']}%" if t["cap"] else "-", t["priority"],
        )
    return table


async def _tenants(client: AdminClient) -> list[dict[str, Any]]:
    return [_snake(t) for t in await client.tenants()]


# --- commands ---


def _json_option(fn: Callable[..., None]) -> Callable[..., None]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(fn)


@main.command()
@_json_option
def status(as_json: bool) -> None:
    """The daemon, its GPUs and tenants."""

    async def query(client: AdminClient) -> dict[str, Any]:
        return {
            **_snake(await client.manager_properties()),
            "gpus": _gpus(await client.call("GetGpus")),
            "tenants": await _tenants(client),
        }

    info = _daemon(query)
    if as_json:
        _echo_json(info)
        return
    console = Console()
    console.print(f"vgpud {info['version']}, default tenant: {info['default_tenant'] or '-'}")
    modes = info.get("sched_mode") or {}
    if modes:
        console.print("scheduling: " + "; ".join(f"GPU {gpu} {mode}"
                                                 for gpu, mode in sorted(modes.items())))
    console.print(_gpu_table(info["gpus"]))
    console.print(_tenant_table(info["tenants"]))


@main.command()
@_json_option
def gpus(as_json: bool) -> None:
    """The GPUs vgpud shares, and the memory tenants hold on each."""
    rows = _gpus(_call("GetGpus"))
    if as_json:
        _echo_json(rows)
    else:
        Console().print(_gpu_table(rows))


@main.group()
def tenant() -> None:
    """List, show, create, delete and change tenants."""


@tenant.command("list")
@_json_option
def tenant_list(as_json: bool) -> None:
    """Tenants in resolution order, with their limits and usage."""
    tenants = _daemon(_tenants)
    if as_json:
        _echo_json(tenants)
    else:
        Console().print(_tenant_table(tenants))


@tenant.command("show")
@click.argument("name")
@_json_option
def tenant_show(name: str, as_json: bool) -> None:
    """One tenant's properties."""

    async def query(client: AdminClient) -> dict[str, Any]:
        return _snake(await client.tenant_properties(await client.call("GetTenant", "s", name)))

    info = _daemon(query)
    if as_json:
        _echo_json(info)
        return
    table = Table.grid(padding=(0, 2))
    for key, value in info.items():
        table.add_row(key, json.dumps(value) if isinstance(value, list | dict) else str(value))
    Console().print(table)


def _memory_option(fn: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--memory", metavar="SIZE", help='Per-GPU limit: 8GiB, 512MiB, 50%; "" for no limit.'
    )(fn)


def _sched_options(fn: Callable[..., None]) -> Callable[..., None]:
    fn = click.option("--weight", type=U32, help="Share of GPU time, 1..1000.")(fn)
    fn = click.option("--cap", type=U32, help="Most GPU time in percent, 1..100; 0: no cap.")(fn)
    return click.option("--priority", metavar="CLASS", help="best-effort or priority.")(fn)


def _limits_option(fn: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--limit", "limits", multiple=True, metavar="KIND=N", callback=_parse_limits,
        help="Most objects of KIND the tenant may hold at once: channel_groups, channels, "
             "context_shares, va_spaces, buffers (repeatable).")(fn)


def _parse_limits(ctx: click.Context, param: click.Parameter,
                  values: tuple[str, ...]) -> dict[str, int]:
    limits: dict[str, int] = {}
    for value in values:
        kind, sep, count = value.partition("=")
        if not sep or not kind or not count.isdigit() or int(count) > 2**32 - 1:
            raise click.BadParameter(f"{value!r} is not KIND=N", param=param)
        limits[kind] = int(count)
    return limits


def _options(**values: tuple[str, Any] | None) -> dict[str, Variant]:
    return {key.replace("_", "-"): Variant(*v) for key, v in values.items() if v is not None}


@tenant.command("create")
@click.argument("name")
@_memory_option
@click.option("--match-cgroup", multiple=True, metavar="GLOB",
              help="Openers whose cgroup v2 path matches (repeatable).")
@click.option("--match-uid", multiple=True, type=U32, help="Openers with this uid (repeatable).")
@click.option("--gpus", metavar="LIST", help="GPU indexes the tenant may use: 0,1 (default all).")
@_sched_options
@_limits_option
def tenant_create(name: str, memory: str | None, match_cgroup: tuple[str, ...],
                  match_uid: tuple[int, ...], gpus: str | None, weight: int | None,
                  cap: int | None, priority: str | None, limits: dict[str, int]) -> None:
    """Create tenant NAME."""
    try:
        indexes = None if gpus is None else [int(i) for i in gpus.split(",")]
    except ValueError:
        raise click.BadParameter(f"{gpus!r} is not a list like 0,1", param_hint="--gpus") from None
    options = _options(
        memory=None if memory is None else ("s", memory),
        match_cgroup=("as", list(match_cgroup)) if match_cgroup else None,
        match_uid=("au", list(match_uid)) if match_uid else None,
        gpus=None if indexes is None else ("au", indexes),
        weight=None if weight is None else ("u", weight),
        cap=None if cap is None else ("u", cap),
        priority=None if priority is None else ("s", priority),
        limits=("a{su}", limits) if limits else None,
    )
    _call("CreateTenant", "sa{sv}", name, options)


@tenant.command("delete")
@click.argument("name")
def tenant_delete(name: str) -> None:
    """Delete tenant NAME (it must have no open contexts)."""
    _call("DeleteTenant", "s", name)


@tenant.command("set")
@click.argument("name")
@_memory_option
@_sched_options
@_limits_option
def tenant_set(name: str, memory: str | None, weight: int | None, cap: int | None,
               priority: str | None, limits: dict[str, int]) -> None:
    """Change tenant NAME's limits (all given options at once, or none)."""
    options = _options(
        memory=None if memory is None else ("s", memory),
        weight=None if weight is None else ("u", weight),
        cap=None if cap is None else ("u", cap),
        priority=None if priority is None else ("s", priority),
        limits=("a{su}", limits) if limits else None,
    )
    if not options:
        raise click.UsageError("nothing to set: give --memory, --weight, --cap, --priority "
                               "or --limit")
    _call("UpdateTenant", "sa{sv}", name, options)


def _top_rows(tenants: list[dict[str, Any]], modes: dict[int, str]) -> list[dict[str, Any]]:
    """One row per tenant and GPU it may use; ``modes``: each GPU's scheduling mode."""
    return [
        {"tenant": t["name"], "gpu": gpu, "memory_used": t["memory_used"].get(gpu, 0),
         "memory_limit": t["memory_limit_bytes"].get(gpu, 0), "weight": t["weight"],
         "cap": t["cap"], "priority": t["priority"], "share": t["share"].get(gpu, 0.0),
         "measured_share": t["measured_share"].get(gpu), "mode": modes.get(gpu, ""),
         "timeslices_us": t["timeslices"].get(gpu, []),
         "preemptions": t["preemptions"].get(gpu, 0)}
        for t in tenants for gpu in t["gpus"]
    ]


def _slices(us: list[int]) -> str:
    """A tenant's timeslices in short: "1024", "4x512", "512..2048"."""
    if not us:
        return "-"
    low, high = min(us), max(us)
    if low == high:
        return str(low) if len(us) == 1 else f"{len(us)}x{low}"
    return f"{low}..{high}"


def _top_table(rows: list[dict[str, Any]], title: str) -> Table:
    modes = sorted({(r["gpu"], r["mode"]) for r in rows if r["mode"]})
    caption = "; ".join(f"GPU {gpu}: {mode}" for gpu, mode in modes) or None
    table = Table("TENANT", "GPU", "MEMORY USED / LIMIT", "WEIGHT", "CAP", "PRIORITY",
                  "SHARE", "MEASURED", "SLICES us", "PREEMPT", title=title, caption=caption)
    for r in rows:
        measured = r["measured_share"]
        table.add_row(
            r["tenant"], str(r["gpu"]), f"{_size(r['memory_used'])} / {_size(r['memory_limit'])}",
            str(r["weight"]), f"{r['cap']}%" if r["cap"] else "-", r["priority"],
            f"{r['share']:.1f}%", "-" if measured is None else f"{measured:.1f}%",
            _slices(r["timeslices_us"]), str(r["preemptions"]),
        )
    return table


async def _top_query(client: AdminClient) -> list[dict[str, Any]]:
    modes = (await client.manager_properties()).get("SchedMode", {})
    return _top_rows(await _tenants(client), modes)


@main.command()
@click.option("--once", is_flag=True, help="Print the table once and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON list of rows (tenant, GPU) and exit.")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="Seconds between refreshes.")
def top(once: bool, as_json: bool, interval: float) -> None:
    """Tenants live, per GPU: memory, weight, cap, priority, target and measured share.

    SHARE is the share of GPU time the scheduler gives the tenant now (0 while
    it has no work there); MEASURED the share it got over the last second.
    SLICES the timeslices set on its channel groups (runlist mode), PREEMPT how
    often its new work preempted the best-effort groups. The caption gives
    each GPU's scheduling mode.
    """
    if as_json or once:
        rows = _daemon(_top_query)
        if as_json:
            _echo_json(rows)
        else:
            Console().print(_top_table(rows, "tenants"))
        return

    async def live(client: AdminClient) -> None:
        title = f"tenants (every {interval:g} s; Ctrl-C quits)"
        with Live(_top_table([], title), auto_refresh=False) as screen:
            while True:
                screen.update(_top_table(await _top_query(client), title), refresh=True)
                await asyncio.sleep(interval)

    with suppress(KeyboardInterrupt):
        _daemon(live)


@main.command()
@click.option("--tenant", "tenant_name", default=None, help="One tenant [default: all].")
@click.option("--kind", default="", help="Calls of one kind: RM_ALLOC, RM_ALLOC:0x3e, "
              "RM_CONTROL:0x20800a11, upcall:OPEN, SCHEDULE [default: all].")
@click.option("--by-kind", is_flag=True, help="A histogram per call kind, not their sum.")
@click.option("--watch", "interval", type=click.FloatRange(min=0.1), default=None,
              is_flag=False, flag_value=2.0, help="Print again every N seconds [2].")
@_json_option
def latency(tenant_name: str | None, kind: str, by_kind: bool, interval: float | None,
            as_json: bool) -> None:
    """Per-tenant latency from the eBPF probes: ioctl total, upcall wait, driver
    time, switch latency, slot wait, as log2 histograms with p50/p99."""

    async def query(client: AdminClient) -> dict[str, list[list[Any]]]:
        names = ([tenant_name] if tenant_name is not None
                 else [t["name"] for t in await _tenants(client)])
        return {name: await client.call("GetLatency", "ss", name, kind) for name in names}

    async def watch(client: AdminClient) -> None:
        while True:
            _print_latency(await query(client), by_kind, as_json)
            if interval is None:
                return
            await asyncio.sleep(interval)

    with suppress(KeyboardInterrupt):
        _daemon(watch)


def _print_latency(rows: dict[str, list[list[Any]]], by_kind: bool, as_json: bool) -> None:
    if as_json:
        _echo_json({tenant: [
            {"kind": call, "histogram": hist, "counts": counts, "sum_ns": sum_ns,
             "mean_ns": Histogram.of(counts, sum_ns).mean_ns,
             "p50_ns": Histogram.of(counts).percentile(0.5),
             "p99_ns": Histogram.of(counts).percentile(0.99)}
            for call, hist, counts, sum_ns in tenant_rows]
            for tenant, tenant_rows in rows.items()})
        return
    for tenant, tenant_rows in rows.items():
        hists = [((call, hist), Histogram.of(counts, sum_ns))
                 for call, hist, counts, sum_ns in tenant_rows]
        if not by_kind:
            hists = [(("all", name), h) for name, h in sorted(by_histogram(hists).items())]
        if not hists:
            click.echo(f"tenant {tenant}: no calls")
        for (call, name), h in hists:
            click.echo(f"tenant {tenant}, {call}, {name}: {summary(h)}")
            for line in log2_lines(h):
                click.echo(line)
            click.echo()


@main.command()
@click.argument("pid", type=U32)
@click.argument("tenant_name", metavar="TENANT")
def bind(pid: int, tenant_name: str) -> None:
    """Process PID's future opens belong to TENANT."""
    _call("BindProcess", "us", pid, tenant_name)


@main.command()
@click.argument("pid", type=U32)
def unbind(pid: int) -> None:
    """Remove the binding of PID."""
    _call("UnbindProcess", "u", pid)


@main.command("bind-cgroup")
@click.argument("path")
@click.argument("tenant_name", metavar="TENANT")
def bind_cgroup(path: str, tenant_name: str) -> None:
    """The processes of cgroup PATH and of the cgroups below it, forked ones
    too, open as TENANT from now on. PATH is from the cgroup2 root, as
    /proc/PID/cgroup's 0:: line has it (e.g. /machine.slice/x.scope)."""
    _call("BindCgroup", "ss", path, tenant_name)


@main.command("unbind-cgroup")
@click.argument("path")
def unbind_cgroup(path: str) -> None:
    """Remove the binding of cgroup PATH."""
    _call("UnbindCgroup", "s", path)


@main.group()
def cdi() -> None:
    """CDI specs for container runtimes (podman, containerd, CRI-O, Docker)."""


@cdi.command("generate")
@click.option("--output", "output", default="-", metavar="DIR|-", show_default=True,
              help="Write DIR/vgpud.io-tenant.json (e.g. /etc/cdi), or print with -.")
def cdi_generate(output: str) -> None:
    """A spec of one device per tenant: vgpud.io/tenant=NAME."""

    async def query(client: AdminClient) -> list[tuple[str, list[int]]]:
        return [(t["Name"], t["Gpus"]) for t in await client.tenants()]

    tenants = _daemon(query)
    try:
        spec = build_spec(tenants, this_hook())
        if output == "-":
            click.echo(render(spec).decode(), nl=False)
        else:
            SpecFile(Path(output)).update(spec)
    except OSError as e:
        _fail(str(e), EX_ERROR)
    for _, reason in spec.skipped:
        click.echo(f"vgpuctl: warning: {reason}", err=True)


@cdi.command("bind")
@click.argument("tenant_name", metavar="TENANT")
def cdi_bind(tenant_name: str) -> None:
    """The CDI spec's createRuntime hook: bind the cgroup of the container
    whose OCI state is on stdin to TENANT, so that every process of the
    container, forked ones too, opens as TENANT (needs the rights of
    `vgpuctl bind-cgroup`)."""
    state = sys.stdin.buffer.read(MAX_STATE_BYTES + 1)
    try:
        cid = record_name(container_state(state).id)
        path = cgroup_v2_path((PROC / str(container_pid(state)) / "cgroup").read_text())
        own = cgroup_line((PROC / "self" / "cgroup").read_text())
    except (OSError, ValueError) as e:
        _fail(str(e), EX_ERROR)
    if within(own, path):
        _fail(f"the container's cgroup {path} holds this hook (the runtime's cgroup): "
              "binding it would bind the runtime too", EX_ERROR)
    _call("BindCgroup", "ss", path, tenant_name)
    try:
        _write_record(cid, path)
    except OSError as e:
        click.echo(f"vgpuctl: warning: {e}: the binding of {path} stays after the "
                   "container stops, until the daemon sees the cgroup gone", err=True)


@cdi.command("unbind")
def cdi_unbind() -> None:
    """The CDI spec's poststop hook: remove the binding `cdi bind` made for
    the container whose OCI state is on stdin (none: nothing to do)."""
    try:
        record = CDI_RECORDS / record_name(
            container_state(sys.stdin.buffer.read(MAX_STATE_BYTES + 1)).id)
        path = record.read_text()
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        _fail(str(e), EX_ERROR)

    async def unbind(client: AdminClient) -> None:
        try:
            await client.call("UnbindCgroup", "s", path)
        except DBusError as e:  # unbound already, or dropped by the daemon: done
            if e.type != "org.vgpud1.Error.InvalidArgument":
                raise

    _daemon(unbind)
    record.unlink(missing_ok=True)


def _write_record(cid: str, path: str) -> None:
    """CDI_RECORDS/ID holds the cgroup path bound for container ID (0600)."""
    CDI_RECORDS.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(CDI_RECORDS / cid, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(path)


@main.command()
def reload() -> None:
    """Re-read the config file (on error the daemon keeps the last good one)."""
    _call("Reload")


if __name__ == "__main__":
    main()
