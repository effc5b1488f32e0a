"""Charge-journal helpers shared by test_journal and test_journal_groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from vgpud.core.ledger import Ledger
from vgpud.store import journal as J
from vgpud.store.journal import Identity

MiB = 2**20
ID = Identity("5f6a1c1e-0000-4000-8000-000000000001", "4242")


def fresh(limit: int = 100 * MiB) -> Ledger:
    ledger = Ledger()
    ledger.set_limit("a", 0, limit)
    ledger.set_limit("b", 0, limit)
    return ledger


def journal_file(tmp_path: Path, *lines: bytes, identity: Identity = ID) -> Path:
    path = tmp_path / "charges"
    path.write_bytes(J._header(identity) + b"".join(lines))
    return path


# Journal state machines: each step writes a file, so fewer examples than the ledger's.
MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def record_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every os.write the journal makes from now on, in order (still written)."""
    writes: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(J.os, "write", spy)
    return writes
