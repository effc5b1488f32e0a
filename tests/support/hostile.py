"""A hostile tenant for the VM tier: code run as an unprivileged uid.

The hostile tests (tests/vm/hostile/) run the attack as TENANT_UID with
setpriv, optionally inside `unshare -Urm` (its own user and mount namespace),
and judge the harm by nvsim's own accounting and by what the tenant's
processes hold afterwards (`backing_fds`).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tests.support import nvclient as nv
from tests.support.guest import ROOT
from tests.support.nvsim import Fds, GroupSampler, HeapSampler
from tests.support.vgpud_proc import Daemon

TENANT_UID = 1003
TENANT_GID = 1003

# What most attacks run against: one tenant "t" of 64 MiB, the tenant's uid.
ONE_TENANT = f"""\
[[tenant]]
name = "t"
memory = "64MiB"
match = [{{ uid = {TENANT_UID} }}]
"""


# A tenant that allocates 48 MiB for each line on its stdin and answers
# [errno, status] (spawn_tenant with stdin=True; `ask` sends a line).
ALLOC_48MIB_PER_LINE = r"""
import json, os, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
print("ready", flush=True)
for _ in sys.stdin:
    r = nv.alloc_memory(fd, tree.client, tree.subdevice, 48 << 20)
    print(json.dumps([r.errno, r.status]), flush=True)
"""


# A tenant that builds its tree through vgpu, then hands the fd to an attacker
# binary (sys.argv[1], then its arguments after FD CLIENT PARENT): PARENT is
# the device when the arguments say "groups", else the subdevice.
RACER = r"""
import os, subprocess, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
parent = tree.device if "groups" in sys.argv else tree.subdevice
out = subprocess.run([sys.argv[1], str(fd), str(tree.client), str(parent), *sys.argv[2:]],
                     pass_fds=(fd,), capture_output=True, text=True, check=True).stdout
print(out.strip())
"""


def race(nvsim: Path, *args: str, limit: int) -> tuple[dict[str, int], list[int]]:
    """Runs the attacker `args` (its binary first) as the tenant (RACER) while
    nvsim's holding for it is sampled: video memory in bytes, or with
    "groups" channel groups. Prints the attacker's figures ("name N ...")
    and the largest sample against `limit` (MiB, or groups); returns both."""
    groups = "groups" in args
    fds = Fds(nv.NvNodes(nvsim))
    try:
        with GroupSampler() if groups else HeapSampler(fds) as held:
            tenant = spawn_tenant(f"import sys; sys.argv[1:] = {json.dumps(args)}\n{RACER}")
            try:
                out, err = tenant.communicate(timeout=900)
            finally:
                tenant.kill()
            assert tenant.returncode == 0, err
    finally:
        fds.close_all()
    unit, div = ("groups", 1) if groups else ("MiB", 1 << 20)
    print(f"race: {out.strip()}; nvsim held for the tenant at most "
          f"{max(held.samples) // div} {unit} in {len(held.samples)} samples, "
          f"{held.samples[-1] // div} at the end (limit {limit})")
    words = out.split()
    return dict(zip(words[::2], map(int, words[1::2]), strict=True)), held.samples


def ask(tenant: subprocess.Popen[str]) -> list[int]:
    """One line to an ALLOC_48MIB_PER_LINE tenant: its [errno, status]."""
    assert tenant.stdin is not None and tenant.stdout is not None
    tenant.stdin.write("go\n")
    tenant.stdin.flush()
    return json.loads(tenant.stdout.readline())


def tenant_argv(code: str, *, userns: bool = False, uid: int = TENANT_UID) -> list[str]:
    """argv that runs Python `code` as `uid` (TENANT_UID; its gid the same number)
    (in a new user+mount namespace if userns), with the repository importable."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all"]
    if userns:
        argv += ["unshare", "--user", "--map-root-user", "--mount"]
    return [*argv, sys.executable, "-c", code]


def spawn_tenant(code: str, *, userns: bool = False, cgroup: Path | None = None,
                 stdin: bool = False, uid: int = TENANT_UID) -> subprocess.Popen[str]:
    """Start the attack; it is placed in `cgroup` (cgroup v2 dir) before it runs.
    With `stdin`, the test can write to its stdin (a pipe)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pre = None
    if cgroup is not None:
        procs = cgroup / "cgroup.procs"

        def pre() -> None:
            procs.write_text(str(os.getpid()))
    return subprocess.Popen(tenant_argv(code, userns=userns, uid=uid), env=env, cwd=ROOT,
                            text=True,
                            stdin=subprocess.PIPE if stdin else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pre)


def run_tenant(code: str, *, userns: bool = False, cgroup: Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    p = spawn_tenant(code, userns=userns, cgroup=cgroup)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@contextlib.contextmanager
def attacker_binary(name: str) -> Iterator[Path]:
    """tests/support/NAME.c built (gcc -O2 -pthread) where the tenant's uid can run it."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        exe = Path(d) / name
        subprocess.run(["gcc", "-O2", "-pthread", "-o", str(exe),
                        str(ROOT / f"tests/support/{name}.c")], check=True)
        yield exe


def uid_pids(uid: int = TENANT_UID) -> list[int]:
    """Every process whose real uid is `uid`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    pids.append(int(d.name))
            except FileNotFoundError:
                continue
    return pids


def backing_fds(pids: Iterable[int], backing_rdevs: set[int]) -> list[str]:
    """fds of these processes that are the backing driver's device files
    (st_rdev in backing_rdevs): what a tenant must never hold."""
    found = []
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                st = os.stat(fd)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev in backing_rdevs:
                found.append(f"{pid}:{fd.name} -> {os.readlink(fd)}")
    return found


def start_daemon(daemon_factory: Callable[..., Daemon], tmp_path: Path,
                 tenants: str) -> Daemon:
    """The real vgpud, without D-Bus, deciding for the `[[tenant]]` tables in
    `tenants` (TOML); its state and charge journal live in `tmp_path`."""
    config = tmp_path / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{tmp_path / "state.json"}"\n'
                      f'charges_path = "{tmp_path / "charges"}"\n\n{tenants}')
    return daemon_factory("--config", str(config), "--no-dbus").start(timeout=300)
