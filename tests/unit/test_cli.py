"""vgpuctl module-stats."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from tests.support.fakekernel import make_stats
from vgpud import cli


def test_module_not_loaded() -> None:
    result = CliRunner().invoke(cli.main, ["module-stats"])
    assert result.exit_code == cli.EX_UNAVAILABLE
    assert "generic netlink family 'vgpu' not found: is vgpu.ko loaded?" in result.output


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch):
    stats = make_stats(upcalls=12, daemon_portid=4242)

    async def query():
        return stats

    monkeypatch.setattr(cli, "query_module_stats", query)
    return stats


def test_json(stats) -> None:
    result = CliRunner().invoke(cli.main, ["module-stats", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == asdict(stats)


def test_table(stats) -> None:
    result = CliRunner().invoke(cli.main, ["module-stats"])
    assert result.exit_code == 0
    assert "daemon_portid" in result.output and "4242" in result.output
