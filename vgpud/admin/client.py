"""A small client of the org.vgpud1 API (what vgpuctl uses)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dbus_fast import BusType, DBusError, Message, MessageType, unpack_variants
from dbus_fast.aio import MessageBus

from vgpud.admin.names import BUS_NAME, MANAGER_INTERFACE, MANAGER_PATH, TENANT_INTERFACE

T = TypeVar("T")

__all__ = ["AdminClient", "DaemonUnavailable"]

# The bus answers these when nobody owns org.vgpud1.
_NOT_RUNNING = frozenset({
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
})


class DaemonUnavailable(Exception):
    def __init__(self, detail: str = "") -> None:
        message = "vgpud is not running (org.vgpud1 not on the system bus)"
        super().__init__(f"{message}: {detail}" if detail else message)


class AdminClient:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls) -> AdminClient:
        """Connect to the system bus ($DBUS_SYSTEM_BUS_ADDRESS or the default)."""
        try:
            bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        except (OSError, ValueError, DBusError) as e:
            raise DaemonUnavailable(f"cannot connect to the system bus: {e}") from e
        return cls(bus)

    def close(self) -> None:
        self.bus.disconnect()

    @classmethod
    async def run(cls, action: Callable[[AdminClient], Awaitable[T]]) -> T:
        """Connect, run ``action`` with the client, disconnect."""
        client = await cls.connect()
        try:
            return await action(client)
        finally:
            client.close()

    async def call(self, member: str, signature: str = "", *body: Any) -> Any:
        """Call org.vgpud1.Manager.`member`; its single result (None if none).
        Raises DBusError (the daemon's named errors) or DaemonUnavailable."""
        reply = await self._call(MANAGER_PATH, MANAGER_INTERFACE, member, signature, body)
        return reply.body[0] if reply.body else None

    async def manager_properties(self) -> dict[str, Any]:
        return await self._properties(MANAGER_PATH, MANAGER_INTERFACE)

    async def tenant_properties(self, path: str) -> dict[str, Any]:
        return await self._properties(path, TENANT_INTERFACE)

    async def tenants(self) -> list[dict[str, Any]]:
        """Every tenant's properties, in resolution order (one call at a time)."""
        return [await self.tenant_properties(path)
                for _, path in await self.call("ListTenants")]

    async def _properties(self, path: str, interface: str) -> dict[str, Any]:
        reply = await self._call(
            path, "org.freedesktop.DBus.Properties", "GetAll", "s", (interface,)
        )
        values: dict[str, Any] = unpack_variants(reply.body[0])
        return values

    async def _call(
        self, path: str, interface: str, member: str, signature: str, body: tuple[Any, ...]
    ) -> Message:
        reply = await self.bus.call(Message(
            destination=BUS_NAME, path=path, interface=interface, member=member,
            signature=signature, body=list(body),
        ))
        assert reply is not None  # only None for NO_REPLY_EXPECTED calls
        if reply.message_type == MessageType.ERROR:
            name = reply.error_name or "org.freedesktop.DBus.Error.Failed"
            if name in _NOT_RUNNING:
                raise DaemonUnavailable()
            raise DBusError(name, str(reply.body[0]) if reply.body else name)
        return reply

