"""Runtime changes to tenants, persisted in /var/lib/vgpud/state.json.

The config file says what the administrator wrote; this file says what was
changed at runtime since (over D-Bus / vgpuctl), so that it survives restarts.

Merge rule (state over config, by tenant name):
- a tenant created at runtime replaces a config tenant of the same name, in
  that tenant's place in config order (rule precedence); others come after the
  config tenants, in creation order;
- a runtime change to a config tenant (memory, weight, cap, priority) overrides
  only the fields it changed; later edits of other fields in the config apply;
- a config tenant deleted at runtime stays deleted until created again;
- pid bindings name tenants and the bound process (its start time and the
  boot it ran in): a binding from another boot, or to a tenant that no
  longer exists, is ignored. Runtime bindings take precedence over config
  `pids`. Bindings written by version 1 had no start time; they are dropped
  on load (a warning says so) and must be made again;
- cgroup bindings, by cgroup path, likewise name the cgroup (its id: the
  inode of its directory) and the boot: cgroup ids do not survive a reboot,
  so a binding from another boot is ignored.
Entries that name tenants no longer in the config are ignored, not errors.

Writes are atomic: a crash at any point leaves either the old or the new file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from vgpud.core.tenants import Binding, CgroupBinding, Tenant, TenantName
from vgpud.store.config import DEFAULT_STATE_PATH, describe

CHANGEABLE = frozenset({"memory", "weight", "cap", "priority", "limits"})


class StateError(Exception):
    """The state file cannot be read or is corrupt: the daemon should not guess."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class ChangeError(ValueError):
    """A runtime change that cannot apply (unknown or existing tenant, bad value)."""


def _check_change(fields: dict[str, Any]) -> dict[str, Any]:
    if unknown := set(fields) - CHANGEABLE:
        raise ValueError(f"not changeable at runtime: {', '.join(sorted(unknown))}")
    return fields


_Pid = Annotated[int, Field(ge=1)]
log = logging.getLogger(__name__)


class PidBinding(BaseModel):
    """A runtime binding: the tenant, and the process as this boot knows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: TenantName
    start: Annotated[int, Field(strict=True, ge=0)]  # /proc/PID/stat starttime
    boot_id: Annotated[str, Field(min_length=1)]


class CgroupPathBinding(BaseModel):
    """A runtime binding of a cgroup (keyed by its path): the tenant, and the
    cgroup as this boot knows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: TenantName
    cgroup_id: Annotated[int, Field(strict=True, ge=1)]  # the directory's inode
    boot_id: Annotated[str, Field(min_length=1)]


def _cgroup_path(path: str) -> str:
    """A bound path: absolute and normalized, not the root (manager checks too)."""
    if (not path.startswith("/") or path == "/" or path.endswith("/") or "//" in path
            or any(part in (".", "..") for part in path.split("/"))):
        raise ValueError(f"{path!r} is not a normalized absolute cgroup path below the root")
    return path


_CgroupPath = Annotated[str, AfterValidator(_cgroup_path)]


class RuntimeState(BaseModel):
    """Everything changed at runtime. Immutable: changes return a new state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1, 2] = 2
    created: tuple[Tenant, ...] = ()
    changed: dict[TenantName, dict[str, Any]] = {}
    deleted: tuple[TenantName, ...] = ()
    bindings: dict[_Pid, PidBinding] = {}
    cgroup_bindings: dict[_CgroupPath, CgroupPathBinding] = {}

    @field_validator("bindings", mode="before")
    @classmethod
    def _drop_unanchored(cls, value: Any) -> Any:
        """Version 1 bound a bare pid, which any later process could inherit."""
        if not isinstance(value, dict):
            return value
        old = {pid: v for pid, v in value.items() if isinstance(v, str)}
        for pid, name in old.items():
            log.warning("state: binding of pid %s to %s has no process start time "
                        "(an older vgpud wrote it): dropped, bind the process again",
                        pid, name)
        return {pid: v for pid, v in value.items() if pid not in old}

    @model_validator(mode="after")
    def _consistent(self) -> RuntimeState:
        names = [t.name for t in self.created]
        if len(set(names)) != len(names):
            raise ValueError("created lists a tenant twice")
        if both := set(names) & (set(self.deleted) | set(self.changed)):
            raise ValueError(f"created and deleted/changed at once: {sorted(both)}")
        for name, fields in self.changed.items():
            _check_change(fields)
            Tenant.model_validate({"name": name, **fields})
        return self

    # --- the merged view ---

    def tenants(self, config: Sequence[Tenant]) -> tuple[Tenant, ...]:
        """The effective tenants, in resolution order (see the module docstring)."""
        created = {t.name: t for t in self.created}
        out: list[Tenant] = []
        for tenant in config:
            if tenant.name in created:
                out.append(created.pop(tenant.name))
            elif tenant.name not in self.deleted:
                fields = self.changed.get(tenant.name)
                out.append(tenant.replace(**fields) if fields else tenant)
        out.extend(created.values())
        return tuple(out)

    def effective_bindings(self, config: Sequence[Tenant], boot_id: str) -> dict[int, Binding]:
        """Runtime bindings made in this boot, to tenants that exist."""
        names = {t.name for t in self.tenants(config)}
        return {pid: Binding(b.tenant, b.start) for pid, b in self.bindings.items()
                if b.tenant in names and b.boot_id == boot_id}

    def effective_cgroup_bindings(self, config: Sequence[Tenant],
                                  boot_id: str) -> tuple[CgroupBinding, ...]:
        """Runtime cgroup bindings made in this boot, to tenants that exist."""
        names = {t.name for t in self.tenants(config)}
        return tuple(CgroupBinding(b.tenant, path, b.cgroup_id)
                     for path, b in self.cgroup_bindings.items()
                     if b.tenant in names and b.boot_id == boot_id)

    # --- changes ---

    def create(self, config: Sequence[Tenant], tenant: Tenant) -> RuntimeState:
        if any(t.name == tenant.name for t in self.tenants(config)):
            raise ChangeError(f"tenant {tenant.name!r} exists")
        return self._with(
            created=(*self.created, tenant),
            deleted=tuple(n for n in self.deleted if n != tenant.name),
        )

    def delete(self, config: Sequence[Tenant], name: str) -> RuntimeState:
        """Delete a tenant and its bindings."""
        self._existing(config, name)
        in_config = any(t.name == name for t in config)
        return self._with(
            created=tuple(t for t in self.created if t.name != name),
            changed={n: f for n, f in self.changed.items() if n != name},
            deleted=(*self.deleted, name) if in_config else self.deleted,
            bindings={p: b for p, b in self.bindings.items() if b.tenant != name},
            cgroup_bindings={p: b for p, b in self.cgroup_bindings.items() if b.tenant != name},
        )

    def change(self, config: Sequence[Tenant], name: str, /, **fields: Any) -> RuntimeState:
        """Set memory / weight / cap / priority / limits of a tenant (validated)."""
        try:
            _check_change(fields)
            updated = self._existing(config, name).replace(**fields)
        except (ValueError, ValidationError) as e:
            raise ChangeError(f"{name}: {e}") from e
        if any(t.name == name for t in self.created):
            return self._with(
                created=tuple(updated if t.name == name else t for t in self.created)
            )
        dumped = updated.model_dump(mode="json", include=set(fields))
        merged = {**self.changed.get(name, {}), **dumped}
        return self._with(changed={**self.changed, name: merged})

    def bind(self, config: Sequence[Tenant], pid: int, binding: PidBinding) -> RuntimeState:
        self._existing(config, binding.tenant)
        if pid < 1:
            raise ChangeError(f"invalid pid {pid}")
        return self._with(bindings={**self.bindings, pid: binding})

    def without_bindings(self, pids: set[int]) -> RuntimeState:
        """The state less the bindings of `pids` (processes that are gone)."""
        if not pids & self.bindings.keys():
            return self
        return self._with(bindings={p: b for p, b in self.bindings.items() if p not in pids})

    def unbind(self, pid: int) -> RuntimeState:
        if pid not in self.bindings:
            raise ChangeError(f"pid {pid} is not bound")
        return self._with(bindings={p: n for p, n in self.bindings.items() if p != pid})

    def bind_cgroup(self, config: Sequence[Tenant], path: str,
                    binding: CgroupPathBinding) -> RuntimeState:
        """Bind the cgroup at `path` (replacing a binding of the same path)."""
        self._existing(config, binding.tenant)
        try:
            _cgroup_path(path)
        except ValueError as e:
            raise ChangeError(str(e)) from e
        return self._with(cgroup_bindings={**self.cgroup_bindings, path: binding})

    def without_cgroups(self, paths: set[str]) -> RuntimeState:
        """The state less the bindings of `paths` (cgroups that are gone)."""
        if not paths & self.cgroup_bindings.keys():
            return self
        return self._with(cgroup_bindings={p: b for p, b in self.cgroup_bindings.items()
                                           if p not in paths})

    def unbind_cgroup(self, path: str) -> RuntimeState:
        if path not in self.cgroup_bindings:
            raise ChangeError(f"cgroup {path} is not bound")
        return self.without_cgroups({path})

    def _existing(self, config: Sequence[Tenant], name: str) -> Tenant:
        for tenant in self.tenants(config):
            if tenant.name == name:
                return tenant
        raise ChangeError(f"no tenant named {name!r}")

    def _with(self, **fields: Any) -> RuntimeState:
        return RuntimeState.model_validate({**dict(self), **fields})


def load_state(path: Path | str = DEFAULT_STATE_PATH) -> RuntimeState:
    """The saved state; an empty one if the file does not exist; StateError if corrupt."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return RuntimeState()
    except (OSError, UnicodeDecodeError) as e:
        raise StateError(path, f"cannot read: {e}") from e
    try:
        return RuntimeState.model_validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise StateError(path, f"corrupt (not JSON): {e}") from e
    except ValidationError as e:
        key, problem = describe(e)
        raise StateError(path, f"corrupt: {key or '(top level)'}: {problem}") from e


def save_state(state: RuntimeState, path: Path | str = DEFAULT_STATE_PATH) -> None:
    """Write atomically and durably: temp file in the same directory, fsync,
    rename over the old file, fsync the directory (so the rename survives)."""
    path = Path(path)
    data = state.model_dump_json(indent=2).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
