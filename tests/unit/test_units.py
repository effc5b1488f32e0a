"""Every shipped systemd unit, judged by systemd's own tools.

`systemd-analyze security --offline=true` scores each service's exposure (0 is
fully sandboxed, 10 not at all): vgpud.service, the daemon that decides
upcalls, must stay at or below MAX_EXPOSURE; every score is printed (`pytest
-s`). `systemd-analyze verify --recursive-errors=yes` must be clean for all
units. Both read copies whose /opt/vgpud/bin/ paths point at this checkout's
venv, as an install would place them (verify checks that executables exist).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
UNIT_SUFFIXES = (".service", ".socket")
INSTALLED_BIN = "/opt/vgpud/bin/"
VENV_BIN = f"{Path(sys.executable).parent}/"
MAX_EXPOSURE = 2.5
OVERALL = re.compile(r"Overall exposure level for (\S+): (\d+\.\d)")

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze not installed (package systemd)")


def shipped_units() -> list[Path]:
    return sorted(p for p in SYSTEMD.iterdir() if p.suffix in UNIT_SUFFIXES)


def installed_copies(dest: Path) -> list[Path]:
    """The units as an install would have them, in ``dest``. A template is also
    copied as an instance (security needs one)."""
    copies = []
    for unit in shipped_units():
        text = unit.read_text().replace(INSTALLED_BIN, VENV_BIN)
        copy = dest / unit.name
        copy.write_text(text)
        copies.append(copy)
        if unit.stem.endswith("@"):
            instance = dest / f"{unit.stem}0{unit.suffix}"
            instance.write_text(text)
            copies.append(instance)
    return copies


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True,
                          check=False)


def exposure(unit: Path, threshold: float = 10.0) -> tuple[float, int]:
    """The overall exposure of ``unit`` and the tool's exit status against
    ``threshold`` (nonzero when the exposure is above it)."""
    res = analyze("security", "--offline=true", f"--threshold={round(threshold * 10)}",
                  str(unit))
    found = OVERALL.search(res.stdout)
    assert found, f"no score for {unit.name}: {res.stdout[-500:]}{res.stderr}"
    return float(found.group(2)), res.returncode


def test_vgpud_is_shipped() -> None:
    assert SYSTEMD / "vgpud.service" in shipped_units()


def test_every_service_scored_and_vgpud_within_bound(tmp_path: Path) -> None:
    services = [u for u in installed_copies(tmp_path)
                if u.suffix == ".service" and not u.stem.endswith("@")]
    scores = {u.name: exposure(u, MAX_EXPOSURE) for u in services}
    print("\nsystemd-analyze security --offline=true:")
    for name, (score, _) in sorted(scores.items()):
        print(f"  {name:32} {score:.1f}")
    score, status = scores["vgpud.service"]
    assert score <= MAX_EXPOSURE and status == 0, scores


def test_sandboxing_is_what_scores(tmp_path: Path) -> None:
    """The bound can fail: the unit without its sandboxing scores above it."""
    unit = tmp_path / "vgpud.service"
    kept = [line for line in (SYSTEMD / "vgpud.service").read_text().splitlines()
            if not line.startswith(("Protect", "SystemCall", "Restrict", "Private"))]
    unit.write_text("\n".join(kept) + "\n")
    score, status = exposure(unit, MAX_EXPOSURE)
    assert score > MAX_EXPOSURE and status != 0


def test_all_units_verify_clean(tmp_path: Path) -> None:
    units = [u for u in installed_copies(tmp_path) if not u.stem.endswith("@")]
    res = analyze("verify", "--recursive-errors=yes", *map(str, units))
    assert (res.returncode, res.stdout + res.stderr) == (0, ""), [u.name for u in units]


def unit_values(name: str, key: str) -> list[str]:
    """The values of ``key=`` in shipped unit ``name``, in order."""
    return [line.split("=", 1)[1] for line in (SYSTEMD / name).read_text().splitlines()
            if line.startswith(f"{key}=")]


def test_probes_helper_within_bound_and_alone_with_cap_bpf(tmp_path: Path) -> None:
    """The latency probes' capabilities live in vgpud-probes.service only; the
    daemon reaches it over the socket vgpud-probes.socket listens on."""
    copies = {u.name: u for u in installed_copies(tmp_path)}
    score, status = exposure(copies["vgpud-probes.service"], MAX_EXPOSURE)
    print(f"\nvgpud-probes.service exposure {score:.1f}")
    assert score <= MAX_EXPOSURE and status == 0
    assert unit_values("vgpud.service", "CapabilityBoundingSet") == [
        "CAP_NET_ADMIN CAP_SYS_NICE"]
    assert unit_values("vgpud-probes.service", "CapabilityBoundingSet") == [
        "CAP_BPF CAP_PERFMON CAP_SYS_ADMIN"]
    (sock,) = unit_values("vgpud-probes.socket", "ListenStream")
    (start,) = unit_values("vgpud.service", "ExecStart")
    assert f"--probes-helper {sock}" in start and "--no-probes" not in start
    assert "vgpud-probes.socket" in unit_values("vgpud.service", "Wants")[0]


def test_the_metrics_exporter_runs_without_privilege(tmp_path: Path) -> None:
    """The HTTP parser is vgpud-metrics@.service's: a dynamic user with an
    empty bounding set and no network of its own, reached by the daemon over
    the socket vgpud-metrics.socket listens on (root's alone)."""
    copies = {u.name: u for u in installed_copies(tmp_path)}
    score, status = exposure(copies["vgpud-metrics@0.service"], 1.0)
    print(f"\nvgpud-metrics@.service exposure {score:.1f}")
    assert score <= 1.0 and status == 0
    for key, value in (("DynamicUser", "yes"), ("CapabilityBoundingSet", ""),
                       ("PrivateNetwork", "yes"), ("RestrictAddressFamilies", "AF_UNIX")):
        assert unit_values("vgpud-metrics@.service", key) == [value], key
    (sock,) = unit_values("vgpud-metrics.socket", "ListenStream")
    assert unit_values("vgpud-metrics.socket", "SocketMode") == ["0600"]
    assert unit_values("vgpud-metrics.socket", "Accept") == ["yes"]
    (start,) = unit_values("vgpud.service", "ExecStart")
    assert f"--metrics-helper {sock}" in start
    assert "vgpud-metrics.socket" in unit_values("vgpud.service", "Wants")[0]
