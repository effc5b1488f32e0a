"""Tenants: the model, memory limit sizes, and who an opener belongs to.

Pure: resolution takes what the kernel module reports about an opener and the
current tenant set, and answers a tenant name (or None: refuse the open).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from types import MappingProxyType
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PlainSerializer,
    PlainValidator,
    model_validator,
)
from pydantic_core import core_schema

from vgpud.core.cgroup_glob import compile_glob, glob_matches

U64_MAX = 2**64 - 1
MAX_GPU_INDEX = 247  # /dev/nvidiaN minors stop below nvidia-modeset/nvidiactl

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")


def validate_name(name: str) -> str:
    """Return `name` if it is a valid tenant name, else raise ValueError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid tenant name {name!r}: 1-32 characters of a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


TenantName = Annotated[str, AfterValidator(validate_name)]

# Binary (IEC) and decimal (SI) units; matched case-insensitively.
_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
}  # fmt: skip
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%")


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """A per-GPU memory limit: an absolute byte count or a percent of the device.

    Exactly one of `bytes` and `percent` is set. Parsed from 8GiB, 512MiB,
    1.5GB, 1073741824 (bytes) or 50% / 12.5%; serialized back with str().
    """

    bytes: int | None = None
    percent: Fraction | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.percent is None):
            raise ValueError("a memory limit is either bytes or a percent")
        if self.bytes is not None and not 0 < self.bytes <= U64_MAX:
            raise ValueError(f"memory limit {self.bytes} out of range 1..2**64-1 bytes")
        if self.percent is not None and not 0 < self.percent <= 100:
            raise ValueError(f"memory limit {self._percent_text()}% out of range (0, 100]")

    @classmethod
    def parse(cls, value: object) -> MemoryLimit:
        """Parse an int (bytes) or a string; raise ValueError saying what is wrong."""
        if isinstance(value, MemoryLimit):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(bytes=value)
        if not isinstance(value, str):
            raise ValueError(f"memory limit must be a size string or an integer, not {value!r}")
        text = value.strip()
        if text.startswith("-"):
            raise ValueError(f"memory limit {value!r} is negative")
        if m := _PERCENT_RE.fullmatch(text):
            return cls(percent=Fraction(m.group(1)))
        m = _SIZE_RE.fullmatch(text)
        if not m:
            raise ValueError(f"invalid memory size {value!r} (examples: 8GiB, 512MiB, 50%)")
        unit = _UNITS.get(m.group(2).lower())
        if unit is None:
            raise ValueError(
                f"unknown unit {m.group(2)!r} in {value!r} (B, KiB, MiB, GiB, TiB, KB, MB, GB...)"
            )
        size = Fraction(m.group(1)) * unit
        if size.denominator != 1:
            raise ValueError(f"memory size {value!r} is not a whole number of bytes")
        return cls(bytes=int(size))

    def effective(self, total: int) -> int:
        """Bytes allowed on a device of `total` bytes; never more than the device."""
        if self.percent is not None:
            return total * self.percent.numerator // (100 * self.percent.denominator)
        assert self.bytes is not None
        return min(self.bytes, total)

    def _percent_text(self) -> str:
        assert self.percent is not None
        # Parsed from a decimal, so the quotient is exact.
        return str(Decimal(self.percent.numerator) / self.percent.denominator)

    def __str__(self) -> str:
        if self.percent is not None:
            return f"{self._percent_text()}%"
        assert self.bytes is not None
        for suffix, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if self.bytes % unit == 0:
                return f"{self.bytes // unit}{suffix}"
        return str(self.bytes)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls.parse, serialization=core_schema.to_string_ser_schema()
        )


class UvmPolicy(StrEnum):
    """Managed memory (nvidia-uvm): refuse it, count its mmap size, or let it pass."""

    DENY = "deny"
    COUNT = "count"
    ALLOW = "allow"


class Priority(StrEnum):
    BEST_EFFORT = "best-effort"
    PRIORITY = "priority"


_StrictInt = Annotated[int, Field(strict=True)]


def _parse_gpus(value: object) -> tuple[int, ...] | Literal["all"]:
    """"all", or distinct GPU indexes (one validator: a union would garble error keys)."""
    if value == "all":
        return "all"
    if not isinstance(value, list | tuple):
        raise ValueError('gpus must be "all" or a list of GPU indexes')
    for gpu in value:
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu <= MAX_GPU_INDEX:
            raise ValueError(f"GPU index {gpu!r} is not an integer in 0..{MAX_GPU_INDEX}")
    if len(set(value)) != len(value):
        raise ValueError("gpus lists an index twice")
    return tuple(value)


_Count = Annotated[int, Field(strict=True, ge=0, le=1_000_000)]


class ObjectLimits(BaseModel):
    """Most objects of each kind a tenant may hold at once, all its GPUs
    together: objects whose video memory the driver allocates implicitly
    (context buffers, instance blocks, page tables), which the quota cannot
    size. 0 refuses every one. Over the limit the driver's own answer for
    exhausted resources (NV_ERR_INSUFFICIENT_RESOURCES) is returned."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    channel_groups: _Count = 256
    channels: _Count = 1024
    context_shares: _Count = 1024
    va_spaces: _Count = 64
    buffers: _Count = 256

    def limit(self, kind: str) -> int:
        value = getattr(self, kind)
        assert isinstance(value, int)
        return value


class MatchRule(BaseModel):
    """One rule; every field given must match (AND). At least one field is given.

    `cgroup` is a glob on the cgroup v2 path (e.g. "/kubepods/*/pod-abc*"):
    `*`, `?` and `[...]` stay within one path component, `**` spans several
    (vgpud.core.cgroup_glob).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cgroup: str | None = None
    uid: Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)] | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> MatchRule:
        if self.cgroup is None and self.uid is None:
            raise ValueError("a match rule needs cgroup or uid")
        if self.cgroup is not None:
            compile_glob(self.cgroup)
        return self

    def matches(self, opener: Opener) -> bool:
        if self.uid is not None and opener.uid != self.uid:
            return False
        return self.cgroup is None or glob_matches(self.cgroup, opener.cgroup_path)


class Tenant(BaseModel):
    """A tenant: who belongs to it, and what it may use on each GPU.

    `memory` applies per GPU; None means the whole device. `pids` bind the
    processes (tgids) running when the config is loaded; a pid reused later
    is not bound (Binding). `cap` (percent of GPU time), `weight` and
    `priority` are for the TDMA scheduler.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: TenantName
    match: tuple[MatchRule, ...] = ()
    pids: tuple[Annotated[int, Field(strict=True, ge=1)], ...] = ()
    memory: MemoryLimit | None = None
    gpus: Annotated[
        tuple[int, ...] | Literal["all"],
        PlainValidator(_parse_gpus),
        PlainSerializer(lambda v: v if v == "all" else list(v), when_used="json"),
    ] = "all"
    uvm: UvmPolicy = UvmPolicy.COUNT
    weight: Annotated[_StrictInt, Field(ge=1, le=1000)] = 100
    cap: Annotated[_StrictInt, Field(ge=1, le=100)] | None = None
    priority: Priority = Priority.BEST_EFFORT
    limits: ObjectLimits = ObjectLimits()

    @model_validator(mode="after")
    def _distinct(self) -> Tenant:
        if len(set(self.pids)) != len(self.pids):
            raise ValueError("pids lists a pid twice")
        return self

    def allows_gpu(self, gpu: int) -> bool:
        return self.gpus == "all" or gpu in self.gpus

    def limit_for(self, gpu: int, total: int) -> int | None:
        """Bytes this tenant may hold on GPU `gpu` of `total` bytes; None if not allowed."""
        if not self.allows_gpu(gpu):
            return None
        return total if self.memory is None else self.memory.effective(total)

    def replace(self, **changes: object) -> Tenant:
        """A copy with `changes` applied and validated (model_copy does not validate)."""
        return Tenant.model_validate({**self.model_dump(), **changes})


# USER_HZ: the unit of /proc/PID/stat's starttime (100 on every architecture
# Debian ships but alpha).
CLOCK_TICKS_PER_SEC = 100


def start_ticks(start_boottime_ns: int) -> int:
    """A process start time from the kernel (ns since boot) in /proc's unit,
    as the kernel converts it (nsec_to_clock_t)."""
    return start_boottime_ns // (10**9 // CLOCK_TICKS_PER_SEC)


@dataclass(frozen=True, slots=True)
class Opener:
    """What the kernel module reports about a process opening an emulated node.

    `start`: the process's start time (clock ticks since boot), when known;
    without it no pid binding applies.
    """

    pid: int
    tgid: int
    uid: int
    gid: int
    cgroup_id: int
    cgroup_path: str
    start: int | None = None


@dataclass(frozen=True, slots=True)
class Binding:
    """A process bound to a tenant: its pid names it only while `start` (clock
    ticks since boot, /proc/PID/stat starttime) is the same, so a later
    process that reuses the pid, in this boot or the next, is not bound."""

    tenant: str
    start: int

    def holds(self, opener: Opener) -> bool:
        return opener.start is not None and opener.start == self.start


# The id of the cgroup now at a path (None: none there), for a binding that
# claims a descendant: the opener carries only its own cgroup's id.
CgroupIdOf = Callable[[str], int | None]


def _no_cgroup(path: str) -> int | None:
    return None


@dataclass(frozen=True, slots=True)
class CgroupBinding:
    """A cgroup v2 subtree bound to a tenant: every process in the cgroup at
    `path` (as the host sees it, from the cgroup2 root: "/machine.slice/x")
    or in a cgroup below it, whenever it forks or moves there.

    `cgroup_id` is the inode of the cgroup's directory (the kernel's cgroup
    id), so that a binding of a cgroup that was removed does not hold for a
    new cgroup created later at the same path, nor for the new one's
    descendants.
    """

    tenant: str
    path: str
    cgroup_id: int

    def holds(self, opener: Opener, cgroup_id_of: CgroupIdOf = _no_cgroup) -> bool:
        """The opener's cgroup is the bound one (the same path and id) or
        below it (the cgroup now at the bound path, `cgroup_id_of`, is the
        bound one)."""
        if opener.cgroup_path == self.path:
            return opener.cgroup_id == self.cgroup_id
        return (opener.cgroup_path.startswith(self.path.rstrip("/") + "/")
                and cgroup_id_of(self.path) == self.cgroup_id)


NO_CGROUP_BINDINGS: Mapping[str, CgroupBinding] = MappingProxyType({})


def cgroup_binding(opener: Opener, bindings: Mapping[str, CgroupBinding],
                   cgroup_id_of: CgroupIdOf = _no_cgroup) -> CgroupBinding | None:
    """The binding (of `bindings`, by path) that claims the opener: that of
    the deepest bound path among the opener's cgroup and its ancestors that
    holds (a container's cgroup bound inside a bound pod's claims its own).
    One lookup per path component, however many bindings there are."""
    path = opener.cgroup_path
    while path.startswith("/") and path != "/":
        binding = bindings.get(path)
        if binding is not None and binding.holds(opener, cgroup_id_of):
            return binding
        path = path.rpartition("/")[0]
    return None


def resolve(
    opener: Opener,
    tenants: Sequence[Tenant],
    bindings: Mapping[int, Binding],
    default: str | None,
    cgroups: Mapping[str, CgroupBinding] = NO_CGROUP_BINDINGS,
    cgroup_id_of: CgroupIdOf = _no_cgroup,
) -> str | None:
    """The tenant an opener belongs to, or None: refuse the open (EACCES).

    Precedence: a binding of the opener's process (its tgid, with the same
    start time), then a binding of its cgroup or of an ancestor cgroup
    (`cgroups`, by bound path; the deepest; `cgroup_id_of` tells whether an
    ancestor is still the bound cgroup), then the first matching rule in
    tenant order, then `default`.
    Inputs are trusted to be consistent (bindings and default name tenants
    that exist); the manager ensures it.
    """
    binding = bindings.get(opener.tgid)
    if binding is not None and binding.holds(opener):
        return binding.tenant
    if (by_cgroup := cgroup_binding(opener, cgroups, cgroup_id_of)) is not None:
        return by_cgroup.tenant
    for tenant in tenants:
        if any(rule.matches(opener) for rule in tenant.match):
            return tenant.name
    return default


class IndexedGpu(Protocol):
    @property
    def index(self) -> int: ...


class TenantDirectory(Protocol):
    """What deciding reads of the tenant set, and only reads: the admin side
    (vgpud.admin.manager.Manager) serves it; the quota policy asks it per call."""

    @property
    def tenants(self) -> Sequence[Tenant]: ...

    @property
    def bindings(self) -> Mapping[int, Binding]: ...

    @property
    def default_tenant(self) -> str | None: ...

    @property
    def cgroup_bindings(self) -> Mapping[str, CgroupBinding]: ...

    @property
    def gpus(self) -> Sequence[IndexedGpu]:
        """The inventory, in index order."""
        ...

    def cgroup_id_of(self, path: str) -> int | None: ...
