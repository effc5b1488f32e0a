"""vgpuctl: the command-line front end.

For now it talks to the module directly (``module-stats``); daemon state over
D-Bus comes later. Exit status 69 (EX_UNAVAILABLE) when the module is absent
or does not answer.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table

from vgpud.kernel.channel import ChannelError, GenlChannel
from vgpud.kernel.codec import DecodeError
from vgpud.kernel.uapi import Stats

__all__ = ["main"]

EX_UNAVAILABLE = 69


async def _query_stats() -> Stats:
    channel = await GenlChannel.open()
    try:
        return await channel.get_stats()
    finally:
        channel.close()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and control vgpud and the vgpu kernel module."""


@main.command("module-stats")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def module_stats(as_json: bool) -> None:
    """The vgpu module's counters (VGPU_CMD_GET_STATS)."""
    try:
        stats = asyncio.run(_query_stats())
    except (ChannelError, DecodeError) as exc:
        click.echo(f"vgpuctl: {exc}", err=True)
        raise SystemExit(EX_UNAVAILABLE) from None
    if as_json:
        click.echo(json.dumps(asdict(stats)))
        return
    table = Table("counter", "value", title="vgpu module")
    for name, value in asdict(stats).items():
        table.add_row(name, str(value))
    Console().print(table)
