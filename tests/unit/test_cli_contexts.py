"""vgpuctl module-contexts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.support.fakekernel import make_context
from vgpud import cli
from vgpud.kernel.uapi import Node


def test_module_not_loaded() -> None:
    result = CliRunner().invoke(cli.main, ["module-contexts"])
    assert result.exit_code == cli.EX_UNAVAILABLE
    assert "generic netlink family 'vgpu' not found: is vgpu.ko loaded?" in result.output


@pytest.fixture
def contexts(monkeypatch: pytest.MonkeyPatch):
    contexts = [make_context(3, pid=4242, tgid=4240),
                make_context(9, Node.GPU, minor=1, cgroup_id=777)]

    async def query():
        return contexts

    monkeypatch.setattr(cli, "query_module_contexts", query)
    return contexts


def test_json(contexts) -> None:
    result = CliRunner().invoke(cli.main, ["module-contexts", "--json"])
    assert result.exit_code == 0
    rows = json.loads(result.output)
    assert [r["ctx_id"] for r in rows] == [3, 9]
    assert [r["node"] for r in rows] == ["ctl", "gpu"]
    assert rows[0] | {"node": Node.CTL} == contexts[0]._asdict()
    assert rows[1]["minor"] == 1 and rows[1]["cgroup_id"] == 777


def test_table(contexts) -> None:
    result = CliRunner().invoke(cli.main, ["module-contexts"])
    assert result.exit_code == 0
    assert "4242" in result.output and "gpu" in result.output
