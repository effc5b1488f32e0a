"""Who may change vgpud: root, or a member of the configured admin group.

The caller is identified by the bus, not by anything it says: the bus daemon
reports the uid (and, on dbus >= 1.13, the groups) the kernel gave it for the
caller's socket (org.freedesktop.DBus.GetConnectionCredentials). Without
groups from the bus, the user's groups come from the group database
(os.getgrouplist).
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

__all__ = ["Caller", "caller_of", "is_admin"]


@dataclass(frozen=True, slots=True)
class Caller:
    uid: int
    gids: tuple[int, ...] | None  # None: the bus did not say


async def caller_of(bus: MessageBus, sender: str) -> Caller | None:
    """The credentials of bus connection `sender`; None if the bus cannot tell."""
    reply = await bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="GetConnectionCredentials",
            signature="s",
            body=[sender],
        )
    )
    if reply is None or reply.message_type != MessageType.METHOD_RETURN:
        return None
    creds = reply.body[0]
    if "UnixUserID" not in creds:
        return None
    gids = creds.get("UnixGroupIDs")
    return Caller(creds["UnixUserID"].value, None if gids is None else tuple(gids.value))


def is_admin(caller: Caller, admin_group: str) -> bool:
    """Root, or a member of `admin_group` (a group name; missing group: root only)."""
    if caller.uid == 0:
        return True
    try:
        gid = grp.getgrnam(admin_group).gr_gid
    except KeyError:
        return False
    if caller.gids is not None:
        return gid in caller.gids
    try:
        user = pwd.getpwuid(caller.uid)
    except KeyError:
        return False
    return gid in os.getgrouplist(user.pw_name, user.pw_gid)
