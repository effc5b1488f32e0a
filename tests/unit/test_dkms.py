"""kmod/dkms.conf run by DKMS itself, for each Debian kernel series.

The source tree is staged as an install would (`make -C kmod dkms-source`),
then `dkms add`, `build` and `install` run with every tree DKMS writes in a
temporary directory: --dkmstree, --sourcetree, --installtree, TMPDIR, a
throwaway signing key (mok_signing_key and mok_certificate, which dkms reads
from the environment before its default of /var/lib/dkms) and --no-depmod.
The system's DKMS state and /lib/modules are checked to be left as they were.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KMOD = ROOT / "kmod"
SYSTEM_DKMS = Path("/var/lib/dkms")


def conf_value(text: str, key: str) -> str:
    match = re.search(rf'^{re.escape(key)}="([^"]*)"$', text, flags=re.M)
    assert match, f"kmod/dkms.conf has no {key}"
    return match.group(1)


def project_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert isinstance(version, str)
    return version


def newest_kernel(series: str) -> str | None:
    """The newest installed kernel release of `series` that has headers."""
    found = [d.name for d in Path("/lib/modules").glob(f"{series}.*")
             if (d / "build/Makefile").exists()]
    return max(found, key=lambda k: [int(n) for n in re.findall(r"\d+", k)], default=None)


def modinfo(ko: Path, field: str) -> str:
    res = subprocess.run(["modinfo", "-F", field, str(ko)], capture_output=True, text=True,
                         check=True)
    return res.stdout.strip()


def test_versions_agree() -> None:
    conf = (KMOD / "dkms.conf").read_text()
    main = (KMOD / "vgpu/main.c").read_text()
    module = re.search(r'^MODULE_VERSION\("([^"]+)"\);$', main, flags=re.M)
    assert module, "kmod/vgpu/main.c has no MODULE_VERSION"
    assert conf_value(conf, "PACKAGE_VERSION") == module.group(1) == project_version()


def test_only_vgpu_is_packaged() -> None:
    conf = (KMOD / "dkms.conf").read_text()
    assert re.findall(r'^BUILT_MODULE_NAME\[\d+\]="([^"]*)"$', conf, flags=re.M) == ["vgpu"]
    assert conf_value(conf, "BUILT_MODULE_LOCATION[0]") == "vgpu/"
    assert "nvsim" not in conf_value(conf, "MAKE[0]")


def system_state(kver: str) -> list[tuple[str, int]]:
    """What a leaking dkms run would change: its own tree and the kernel's indexes."""
    paths = [*SYSTEM_DKMS.rglob("*"), *Path(f"/lib/modules/{kver}").iterdir()]
    return sorted((str(p), p.lstat().st_mtime_ns) for p in paths)


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_dkms_install(series: str, tmp_path: Path) -> None:
    if shutil.which("dkms") is None:
        pytest.skip("dkms not installed (scripts/install-deps)")
    kver = newest_kernel(series)
    if kver is None:
        pytest.skip(f"no Debian {series} kernel headers (linux-headers-{series}*-amd64)")
    if os.geteuid() != 0:
        pytest.skip("dkms install refuses to run unprivileged")
    version = project_version()
    src, tree, inst = tmp_path / "src", tmp_path / "dkms", tmp_path / "lib-modules"
    (inst / kver).mkdir(parents=True)
    tree.mkdir()
    subprocess.run(["make", "-s", "-C", str(KMOD), "dkms-source",
                    f"DKMS_SRC={src}/vgpu-{version}"], check=True)
    assert not list(src.rglob("*nvsim*")) and not list(src.rglob("*.o"))

    env = {**os.environ, "TMPDIR": str(tmp_path), "mok_signing_key": str(tmp_path / "mok.key"),
           "mok_certificate": str(tmp_path / "mok.pub")}
    trees = ["--dkmstree", str(tree), "--sourcetree", str(src), "--installtree", str(inst)]
    before = system_state(kver)
    for action in (["add"], ["build", "-k", kver], ["install", "-k", kver, "--no-depmod"]):
        res = subprocess.run(["dkms", *action, f"vgpu/{version}", *trees], env=env,
                             capture_output=True, text=True, check=False)
        assert res.returncode == 0, f"dkms {action[0]}:\n{res.stdout}{res.stderr}"
    status = subprocess.run(["dkms", "status", *trees], env=env, capture_output=True,
                            text=True, check=True).stdout
    assert f"vgpu/{version}, {kver}, x86_64: installed" in status
    assert system_state(kver) == before

    installed = [p for p in inst.rglob("*") if p.is_file()]
    assert [p.parent.relative_to(inst) for p in installed] == [Path(kver, "updates/dkms")]
    ko = installed[0]
    assert re.fullmatch(r"vgpu\.ko(\.xz|\.zst|\.gz)?", ko.name), ko.name
    assert modinfo(ko, "vermagic").split()[0] == kver
    assert modinfo(ko, "version") == version
