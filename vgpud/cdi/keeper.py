"""The daemon's observer of the Manager that keeps the CDI spec current.

It rewrites the spec at start and when a change can change it: tenants added
or removed, or a tenant's GPU set changed (a reload). Usage, limits and
bindings leave the spec as it is, so the upcall path never waits on it. A
spec that cannot be written is logged; the daemon goes on (containers get
the last spec written, or none).
"""

from __future__ import annotations

import logging

from vgpud.admin.manager import Manager, ManagerEvent, TenantChanged, TenantsChanged
from vgpud.cdi.files import SpecFile
from vgpud.cdi.spec import Hook, Spec, build_spec, tenant_gpus

__all__ = ["SpecKeeper"]

log = logging.getLogger(__name__)


class SpecKeeper:
    def __init__(self, manager: Manager, spec_file: SpecFile, hook: Hook) -> None:
        self._manager = manager
        self._file = spec_file
        self._hook = hook
        self._skipped: frozenset[tuple[str, str]] = frozenset()

    def spec(self) -> Spec:
        inventory = [gpu.index for gpu in self._manager.gpus]
        return build_spec(((t.name, tenant_gpus(t.gpus, inventory))
                           for t in self._manager.tenants), self._hook)

    def start(self) -> None:
        self.refresh()

    def notify(self, event: ManagerEvent, /) -> None:
        match event:
            case TenantsChanged():
                self.refresh()
            case TenantChanged(fields=fields) if "gpus" in fields:
                self.refresh()

    def refresh(self) -> None:
        spec = self.spec()
        skipped = frozenset(spec.skipped)
        for _, reason in sorted(skipped - self._skipped):
            log.warning("CDI: %s", reason)
        self._skipped = skipped
        try:
            self._file.update(spec)
        except OSError as exc:
            log.error("CDI: cannot write %s: %s", self._file.path, exc)
            return
        log.info("CDI: %s: %d devices", self._file.path, len(spec.content["devices"]))

    def stop(self) -> None:
        """Remove the spec: without the daemon no container can be bound."""
        try:
            self._file.remove()
        except OSError as exc:
            log.error("CDI: cannot remove %s: %s", self._file.path, exc)
