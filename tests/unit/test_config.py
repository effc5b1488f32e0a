"""TOML configuration: a full file, and errors that name file, key and problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpud.core.tenants import MatchRule, MemoryLimit, Priority, UvmPolicy
from vgpud.store.config import (
    DEFAULT_STATE_PATH,
    ConfigError,
    DaemonSettings,
    load_config,
    parse_config,
)

FULL = """
[daemon]
default_tenant = "shared"
admin_group = "gpu-admins"
frame_ms = 50
state_path = "/tmp/vgpud-state.json"

[[tenant]]
name = "alice"
memory = "8GiB"
gpus = [0, 1]
uvm = "deny"
weight = 300
cap = 50
priority = "priority"
pids = [4242]
match = [{ cgroup = "/kubepods/*/pod-alice*" }, { uid = 1000 }]

[[tenant]]
name = "shared"
memory = "25%"

[[tenant]]
name = "batch"
[[tenant.match]]
uid = 2000
cgroup = "/batch.slice/*"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vgpud.toml"
    path.write_text(text)
    return path


def test_full_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    d = config.daemon
    assert (d.default_tenant, d.admin_group, d.frame_ms) == ("shared", "gpu-admins", 50)
    assert d.state_path == Path("/tmp/vgpud-state.json")
    alice, shared, batch = config.tenants
    assert alice.name == "alice"
    assert alice.memory == MemoryLimit(bytes=8 * 2**30)
    assert alice.gpus == (0, 1)
    assert alice.uvm is UvmPolicy.DENY
    assert (alice.weight, alice.cap, alice.priority) == (300, 50, Priority.PRIORITY)
    assert alice.pids == (4242,)
    assert alice.match == (MatchRule(cgroup="/kubepods/*/pod-alice*"), MatchRule(uid=1000))
    assert shared.limit_for(0, 80 * 2**30) == 20 * 2**30
    assert batch.match == (MatchRule(uid=2000, cgroup="/batch.slice/*"),)


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config.tenants == ()
    assert config.daemon == DaemonSettings()
    assert config.daemon.default_tenant is None
    assert config.daemon.state_path == DEFAULT_STATE_PATH
    assert (config.daemon.sched_mode, config.daemon.sched_activity) == ("runlist", "auto")
    assert config.probes.enabled and config.probes.interval_ms == 1000


def test_metrics_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[metrics]\nenabled = true\nlisten = "[::1]:9500"\n'
                                         'helper = "/run/vgpud-metrics.sock"\n'))
    assert (config.metrics.enabled, config.metrics.listen, config.metrics.helper) == (
        True, "[::1]:9500", Path("/run/vgpud-metrics.sock"))
    assert load_config(write(tmp_path, "")).metrics.helper is None


def test_probes_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[probes]\nenabled = false\ninterval_ms = 250\n"))
    assert (config.probes.enabled, config.probes.interval_ms) == (False, 250)


TENANT_A = '[[tenant]]\nname = "a"\n'


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ('[[tenant]]\nname = "a"\n[[tenant]]\nname = "b"\nmemory = "8XB"', "tenant[1].memory",
         "unknown unit"),
        (TENANT_A + 'memory = "-1GiB"', "tenant[0].memory", "negative"),
        (TENANT_A + 'memory = "0%"', "tenant[0].memory", "out of range"),
        (TENANT_A + 'memory = "18446744073709551616"', "tenant[0].memory", "out of range"),
        (TENANT_A + 'gpus = [0, "x"]', "tenant[0].gpus", "GPU index 'x'"),
        (TENANT_A + 'gpus = "some"', "tenant[0].gpus", "all"),
        ('[[tenant]]\nname = "Alice"', "tenant[0].name", "invalid tenant name"),
        ("[[tenant]]\nweight = 5", "tenant[0].name", "Field required"),
        (TENANT_A + "colour = 1", "tenant[0].colour", "unknown key"),
        (TENANT_A + "match = [{ gid = 5 }]", "tenant[0].match[0].gid", "unknown key"),
        (TENANT_A + "match = [{}]", "tenant[0].match[0]", "needs cgroup or uid"),
        (TENANT_A + "weight = 0", "tenant[0].weight", "greater than or equal to 1"),
        (TENANT_A + 'weight = "100"', "tenant[0].weight", "valid integer"),
        (TENANT_A + "cap = 101", "tenant[0].cap", "less than or equal to 100"),
        (TENANT_A + 'uvm = "maybe"', "tenant[0].uvm", "'deny', 'count' or 'allow'"),
        (TENANT_A + 'priority = "high"', "tenant[0].priority", "best-effort"),
        ("[daemon]\nfail_open = true", "daemon.fail_open",
         "the vgpu module's parameter fail_open decides"),
        ("[daemon]\nupcall_timeout_ms = 500", "daemon.upcall_timeout_ms",
         "/sys/module/vgpu/parameters/upcall_timeout_ms"),
        ("[daemon]\nframe_ms = 0", "daemon.frame_ms", "greater than or equal to 1"),
        ("[daemon]\nsched_mode = \"tdma\"", "daemon.sched_mode", "'runlist' or 'frame'"),
        ("[daemon]\nsched_activity = \"nvml\"", "daemon.sched_activity", "'auto' or 'none'"),
        ("[daemon]\nverbose = true", "daemon.verbose", "unknown key"),
        ("[daemon]\ndefault_tenant = \"zz\"", "daemon.default_tenant", "no tenant named 'zz'"),
        ("[deamon]\nfail_open = true", "deamon", "unknown key"),
        ("tenants = []", "tenants", "unknown key"),
        (TENANT_A + TENANT_A, "tenant[1].name", "duplicate tenant 'a'"),
        (TENANT_A + "pids = [7]\n" + '[[tenant]]\nname = "b"\npids = [7]', "tenant[1].pids",
         "pid 7 is already bound to 'a'"),
        ("[daemon\n", "", "invalid TOML"),
        ("[probes]\nenabled = 1", "probes.enabled", "valid boolean"),
        ("[probes]\ninterval_ms = 50", "probes.interval_ms", "greater than or equal to 100"),
        ("[probes]\ninterval_ms = 60001", "probes.interval_ms", "less than or equal to 60000"),
        ("[probes]\nheaders = \"/usr/src\"", "probes.headers", "unknown key"),
        ("[probes]\nhelper = \"probes.sock\"", "probes.helper",
         "a helper's socket must be an absolute path, not probes.sock"),
        ("[metrics]\nhelper = \"run/m.sock\"", "metrics.helper",
         "a helper's socket must be an absolute path, not run/m.sock"),
    ],
)  # fmt: skip
def test_errors_name_file_key_problem(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.file == str(path)
    assert error.key == key
    assert problem in error.problem
    assert str(path) in str(error)
    assert key in str(error)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.key == ""


def test_parse_config_names_the_given_file() -> None:
    with pytest.raises(ConfigError, match=r"^/etc/vgpud/vgpud\.toml: x: unknown key$"):
        parse_config("x = 1", "/etc/vgpud/vgpud.toml")
