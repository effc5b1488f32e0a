"""Fixtures of the hostile tier: the real daemon the attacks run against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import ONE_TENANT, start_daemon
from tests.support.vgpud_proc import Daemon


@pytest.fixture
def daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    """The real vgpud deciding for ONE_TENANT; its log is printed afterwards.
    A test with another tenant table defines its own."""
    d = start_daemon(daemon_factory, tmp_path, ONE_TENANT)
    yield d
    print(d.log())
