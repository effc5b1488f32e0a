"""Fixtures of the host tier shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.bus import PrivateBus, ServiceThread, make_manager, write_config


@pytest.fixture
def system_bus(monkeypatch: pytest.MonkeyPatch) -> Iterator[PrivateBus]:
    """A private system bus; DBUS_SYSTEM_BUS_ADDRESS points at it."""
    bus = PrivateBus()
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus.address)
    yield bus
    bus.close()


@pytest.fixture
def service(system_bus: PrivateBus, tmp_path: Path) -> Iterator[ServiceThread]:
    """The admin service over the two-tenant config of tests.support.bus."""
    thread = ServiceThread(make_manager(write_config(tmp_path)))
    yield thread
    thread.close()
