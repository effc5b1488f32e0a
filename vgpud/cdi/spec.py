"""The CDI spec of the tenants' devices, built and rendered without I/O.

One device per tenant, named after it, of kind ``vgpud.io/tenant``: the
tenant's emulated nodes (nvidiactl, nvidia-uvm and nvidiaN of each GPU the
tenant may use) at the container paths NVIDIA's own nodes have, and two
hooks that the runtime runs as itself with the container's state on stdin: a
createRuntime hook, ``vgpuctl cdi bind TENANT``, that binds the container's
cgroup (every process in it, forked ones too) to the tenant before the
container's process runs anything, and a poststop hook, ``vgpuctl cdi
unbind``, that removes that binding (docs/architecture.md, CDI).

cdiVersion 0.5.0: the first with ``hostPath`` (the container path differs
from the host's), and the newest that Debian 12's podman 4.3.1 accepts (it
vendors container-device-interface 0.5, which knows 0.1.0 to 0.5.0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CDI_VERSION", "CLASS", "HOST_NODE_DIR", "KIND", "SPEC_FILE", "VENDOR", "Hook",
    "InvalidDeviceName", "Spec", "build_spec", "device_name", "render", "tenant_gpus",
]

CDI_VERSION = "0.5.0"
VENDOR = "vgpud.io"
CLASS = "tenant"
KIND = f"{VENDOR}/{CLASS}"
# The spec file's name in the spec directory: the only file vgpud writes or removes there.
SPEC_FILE = "vgpud.io-tenant.json"
HOST_NODE_DIR = "/dev/vgpu"  # udev/70-vgpu.rules, the vgpu module's nodes
CONTAINER_NODE_DIR = "/dev"

# CDI's device name rule (container-device-interface ValidateDeviceName):
# letters, digits, '-', '_', '.', ':'; the first and the last a letter or digit.
_DEVICE_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class InvalidDeviceName(ValueError):
    """A tenant whose name CDI does not accept as a device name."""


def device_name(tenant: str) -> str:
    """The CDI device name of a tenant: the tenant's name itself.

    Tenant names (a-z 0-9 . _ -, starting with a letter or digit) are CDI
    device names unless they end with '.', '_' or '-'; those are refused
    rather than renamed, so that a device name always names one tenant.
    """
    if not _DEVICE_NAME_RE.fullmatch(tenant):
        raise InvalidDeviceName(
            f"tenant {tenant!r} has no CDI device: a CDI device name is letters, digits, "
            "'-', '_', '.', ':' and ends with a letter or digit (rename the tenant)")
    return tenant


@dataclass(frozen=True, slots=True)
class Hook:
    """The hook program (an absolute path to vgpuctl) and its environment
    ("KEY=value": the runtime runs a hook with nothing else)."""

    path: str
    env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"the CDI hook path must be absolute, not {self.path!r}")
        for item in self.env:
            if "=" not in item or item.startswith("="):
                raise ValueError(f"hook environment entry {item!r} is not KEY=value")


@dataclass(frozen=True, slots=True)
class Spec:
    """A spec, and the tenants left out of it with the reason for each."""

    content: dict[str, Any]
    skipped: tuple[tuple[str, str], ...] = ()


def tenant_gpus(gpus: tuple[int, ...] | Literal["all"],
                inventory: Iterable[int]) -> tuple[int, ...]:
    """The GPUs of the inventory a tenant may use (``gpus`` "all" or indexes), in order."""
    return tuple(sorted(i for i in set(inventory) if gpus == "all" or i in gpus))


def _node(name: str) -> dict[str, str]:
    return {"path": f"{CONTAINER_NODE_DIR}/{name}", "hostPath": f"{HOST_NODE_DIR}/{name}"}


def _device(tenant: str, gpus: Sequence[int], hook: Hook) -> dict[str, Any]:
    nodes = ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in gpus)]
    hooks: list[dict[str, Any]] = [
        {"hookName": "createRuntime", "path": hook.path,
         "args": ["vgpuctl", "cdi", "bind", tenant]},
        {"hookName": "poststop", "path": hook.path, "args": ["vgpuctl", "cdi", "unbind"]},
    ]
    if hook.env:
        for entry in hooks:
            entry["env"] = list(hook.env)
    return {
        "name": device_name(tenant),
        "containerEdits": {"deviceNodes": [_node(n) for n in nodes], "hooks": hooks},
    }


def build_spec(tenants: Iterable[tuple[str, Sequence[int]]], hook: Hook) -> Spec:
    """The spec of ``tenants`` ((name, GPU indexes) in the daemon's order).

    A tenant without a GPU gets no device (nothing to hand a container); nor
    does one whose name is no CDI device name. Both are in ``skipped``.
    """
    devices: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    for name, gpus in tenants:
        if not gpus:
            skipped.append((name, f"tenant {name!r} has no CDI device: it may use no GPU"))
            continue
        try:
            devices.append(_device(name, gpus, hook))
        except InvalidDeviceName as exc:
            skipped.append((name, str(exc)))
    return Spec({"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices}, tuple(skipped))


def render(spec: Spec) -> bytes:
    """The spec file's bytes (JSON, which every CDI consumer reads)."""
    return (json.dumps(spec.content, indent=2) + "\n").encode()
