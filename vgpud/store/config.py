"""The daemon's TOML configuration (/etc/vgpud/vgpud.toml).

    [daemon]
    default_tenant = "shared"      # openers matching no tenant; unset: refuse (EACCES)
    admin_group = "vgpu-admin"     # may change tenants at runtime
    frame_ms = 100                 # TDMA frame length (frame mode); caps' period (runlist)
    sched_mode = "runlist"         # or "frame": how GPU time is shared (docs/operations.md)
    sched_activity = "auto"        # or "none": no activity source (nvsim, NVML) is polled
    state_path = "/var/lib/vgpud/state.json"
    charges_path = "/run/vgpud/charges"   # charge journal (a tmpfs: kept across restarts)

    [probes]
    enabled = true                 # latency probes (bcc), when bcc, headers and tracefs allow
    interval_ms = 1000             # how often the daemon reads their maps
    helper = "/run/vgpud-probes.sock"  # load them in vgpud-probes (unset: in vgpud itself)

    [fs]
    enabled = true                 # the cgroup-style file view (FUSE)
    mountpoint = "/run/vgpud/fs"

    [metrics]
    enabled = false                # Prometheus metrics over HTTP
    listen = "127.0.0.1:9400"      # host:port; loopback only unless said otherwise
    helper = "/run/vgpud-metrics.sock"  # serve them from vgpud-metrics (unset: a child)

    [cdi]
    enabled = true                 # keep a CDI spec of the tenants' devices current
    spec_dir = "/var/run/cdi"      # where container runtimes read CDI specs

    [[tenant]]
    name = "alice"
    memory = "8GiB"                # per GPU: bytes, 8GiB, 512MiB, or 50% of the device
    gpus = [0, 1]                  # or "all" (the default)
    uvm = "count"                  # deny | count | allow
    weight = 100                   # 1..1000
    cap = 50                       # percent of GPU time, optional
    priority = "best-effort"       # or "priority"
    pids = [4242]                  # explicit bindings by process id
    match = [{ cgroup = "/kubepods/*/pod-alice*/**" }, { uid = 1000 }]

Tenant order matters: an opener gets the first tenant with a matching rule.
Unknown keys are errors; every error names the file, the key and the problem.
What happens while no daemon answers (the fail policy, the upcall timeout)
is the vgpu module's to decide, through its parameters: ``daemon.fail_open``
and ``daemon.upcall_timeout_ms``, which vgpud once accepted without applying,
are refused with a message that names the parameter to set instead.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from vgpud.core.tenants import Tenant, TenantName
from vgpud.metrics.listen import parse_listen

DEFAULT_CONFIG_PATH = Path("/etc/vgpud/vgpud.toml")
DEFAULT_STATE_PATH = Path("/var/lib/vgpud/state.json")
DEFAULT_CHARGES_PATH = Path("/run/vgpud/charges")


class ConfigError(Exception):
    """A configuration problem: which file, which key (dotted, e.g. tenant[1].memory), what."""

    def __init__(self, file: Path | str, key: str, problem: str) -> None:
        self.file = str(file)
        self.key = key
        self.problem = problem
        where = f"{self.file}: {key}" if key else self.file
        super().__init__(f"{where}: {problem}")


_Ms = Annotated[int, Field(strict=True, ge=1, le=60_000)]

# [daemon] keys that are the module's parameters, not vgpud's settings.
_MODULE_PARAMETERS = ("fail_open", "upcall_timeout_ms")


class DaemonSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_tenant: TenantName | None = None
    admin_group: str = "vgpu-admin"
    frame_ms: _Ms = 100
    # runlist: the GPU's round robin slices time, vgpud sets each channel group's
    # timeslice; frame: vgpud switches tenants on and off in frames of frame_ms.
    sched_mode: Literal["runlist", "frame"] = "runlist"
    # auto: nvsim's counters, else NVML, else none; none: never poll one.
    sched_activity: Literal["auto", "none"] = "auto"
    state_path: Path = DEFAULT_STATE_PATH
    charges_path: Path = DEFAULT_CHARGES_PATH


def _absolute(value: Path | None) -> Path | None:
    if value is not None and not value.is_absolute():
        raise ValueError(f"a helper's socket must be an absolute path, not {value}")
    return value


HelperSocket = Annotated[Path | None, AfterValidator(_absolute)]


class ProbeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, strict=True)
    interval_ms: Annotated[int, Field(strict=True, ge=100, le=60_000)] = 1000
    # The vgpud-probes socket: the probes are loaded there (the daemon then needs
    # no CAP_BPF); None: in this process.
    helper: HelperSocket = None


class FsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, strict=True)
    mountpoint: Path = Path("/run/vgpud/fs")


class MetricsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, strict=True)
    listen: str = Field(default="127.0.0.1:9400", strict=True)
    # The vgpud-metrics socket: its unit renders and serves them (the HTTP
    # parser then runs with no capability); None: a child of this process.
    helper: HelperSocket = None

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class CdiSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, strict=True)
    spec_dir: Path = Path("/var/run/cdi")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon: DaemonSettings = DaemonSettings()
    probes: ProbeSettings = ProbeSettings()
    fs: FsSettings = FsSettings()
    metrics: MetricsSettings = MetricsSettings()
    cdi: CdiSettings = CdiSettings()
    tenants: tuple[Tenant, ...] = Field(default=(), validation_alias="tenant")


def load_config(path: Path | str = DEFAULT_CONFIG_PATH) -> Config:
    """Read and validate the configuration file; raise ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(path, "", f"cannot read: {e}") from e
    return parse_config(text, path)


def parse_config(text: str, file: Path | str = "<config>") -> Config:
    """Validate TOML text; `file` is only used in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(file, "", f"invalid TOML: {e}") from e
    _check_module_parameters(data, file)
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(file, *describe(e)) from e
    _check_consistency(config, file)
    return config


def describe(error: ValidationError) -> tuple[str, str]:
    """The first error of a validation: its dotted key and the problem in words."""
    first = error.errors()[0]
    key = ""
    for part in first["loc"]:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    if first["type"] == "extra_forbidden":
        return key, "unknown key"
    return key, first["msg"].removeprefix("Value error, ")


def _check_module_parameters(data: dict[str, object], file: Path | str) -> None:
    daemon = data.get("daemon")
    for name in _MODULE_PARAMETERS:
        if isinstance(daemon, dict) and name in daemon:
            raise ConfigError(
                file, f"daemon.{name}",
                f"not a vgpud setting: the vgpu module's parameter {name} decides (options "
                f"vgpu {name}=... in /etc/modprobe.d/vgpu.conf, or live in "
                f"/sys/module/vgpu/parameters/{name})")


def _check_consistency(config: Config, file: Path | str) -> None:
    """Checks across tenants: unique names and pids, an existing default tenant."""
    names: set[str] = set()
    pids: dict[int, str] = {}
    for i, tenant in enumerate(config.tenants):
        if tenant.name in names:
            raise ConfigError(file, f"tenant[{i}].name", f"duplicate tenant {tenant.name!r}")
        names.add(tenant.name)
        for pid in tenant.pids:
            if pid in pids:
                raise ConfigError(
                    file, f"tenant[{i}].pids", f"pid {pid} is already bound to {pids[pid]!r}"
                )
            pids[pid] = tenant.name
    default = config.daemon.default_tenant
    if default is not None and default not in names:
        raise ConfigError(file, "daemon.default_tenant", f"no tenant named {default!r}")
