"""vgpuctl module-stats."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from tests.support.fakekernel import make_stats, make_stats4
from vgpud import cli


def test_module_not_loaded() -> None:
    result = CliRunner().invoke(cli.main, ["module-stats"])
    assert result.exit_code == cli.EX_UNAVAILABLE
    assert "generic netlink family 'vgpu' not found: is vgpu.ko loaded?" in result.output


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch):
    stats = make_stats(upcalls=12, daemon_portid=4242)
    stats4 = make_stats4(throttled=77)

    async def query():
        return stats, stats4

    monkeypatch.setattr(cli, "query_module_counters", query)
    return stats, stats4


def test_json(stats) -> None:
    result = CliRunner().invoke(cli.main, ["module-stats", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == asdict(stats[0]) | asdict(stats[1])
    assert json.loads(result.output)["throttled"] == 77


def test_table(stats) -> None:
    result = CliRunner().invoke(cli.main, ["module-stats"])
    assert result.exit_code == 0
    assert "daemon_portid" in result.output and "4242" in result.output
