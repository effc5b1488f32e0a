"""The D-Bus names of the admin API (docs/dbus-api.md), shared by the service and
its clients: vgpuctl loads these and not the service."""

from __future__ import annotations

__all__ = ["BUS_NAME", "ERROR", "MANAGER_INTERFACE", "MANAGER_PATH", "TENANT_INTERFACE",
           "tenant_path"]

BUS_NAME = "org.vgpud1"
MANAGER_PATH = "/org/vgpud1"
MANAGER_INTERFACE = "org.vgpud1.Manager"
TENANT_INTERFACE = "org.vgpud1.Tenant"
TENANT_PATH = "/org/vgpud1/tenant/"
ERROR = "org.vgpud1.Error."


def tenant_path(name: str) -> str:
    """The object path of a tenant: bytes outside [A-Za-z0-9] become _xx (hex),
    as systemd escapes unit names (a.b-c -> a_2eb_2dc)."""
    return TENANT_PATH + "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}"
                                 for c in name)
