"""The parts of vgpud that nvtrace drives, imported here and nowhere else in
tools.nvtrace, so that a move of those modules is followed in one place.

Imports are made when asked for: the decoders need only the standard library,
while the quota stack needs pydantic, which a GPU
machine may lack; ``QuotaStackMissing`` then says what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["QuotaStack", "QuotaStackMissing", "nvml_inventory", "quota_stack"]

# The replay's tenant: every opener; a limit of the whole device (so that memory
# queries take the virtualized-view path, and nothing is refused); managed
# memory not counted (the ledger then holds exactly the device memory the RM
# calls allocate).
REPLAY_CONFIG = """\
[daemon]
default_tenant = "trace"

[[tenant]]
name = "trace"
memory = "100%"
uvm = "allow"
"""


class QuotaStackMissing(Exception):
    """vgpud's quota stack cannot be imported here (a module it needs is missing)."""


class QuotaStack(NamedTuple):
    """The policy as the daemon runs it, over a fresh ledger."""

    dispatcher: Any  # vgpud.policy.dispatch.Dispatcher
    policy: Any  # vgpud.policy.quota.QuotaPolicy
    ledger: Any  # vgpud.core.ledger.Ledger


def quota_stack(gpus: Iterable[tuple[int, str, int]]) -> QuotaStack:
    """Dispatcher -> QuotaPolicy -> Manager/Ledger for the replay's tenant.

    ``gpus``: the inventory, (index, name, total bytes)."""
    try:
        from vgpud.admin.manager import Manager
        from vgpud.core.ledger import Ledger
        from vgpud.policy.dispatch import Dispatcher
        from vgpud.policy.quota import QuotaPolicy
        from vgpud.store.config import parse_config
        from vgpud.store.state import RuntimeState
    except ImportError as exc:
        raise QuotaStackMissing(f"{exc.name or exc}: {exc}") from exc
    ledger = Ledger()
    manager = Manager(Path("<replay>"), parse_config(REPLAY_CONFIG), RuntimeState(), ledger,
                      gpus)
    policy = QuotaPolicy(manager, ledger, truth=False)  # no driver to ask in a replay
    return QuotaStack(Dispatcher(policy), policy, ledger)


def nvml_inventory() -> list[tuple[int, str, int]]:
    """What the daemon's NVML inventory finds on this machine."""
    from vgpud.host.inventory import from_nvml

    return [(g.number, g.name, g.total) for g in from_nvml()]
