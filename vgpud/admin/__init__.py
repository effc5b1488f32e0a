"""The admin layer: the D-Bus service (dbus), caller authorization (auth), a client (client)."""
