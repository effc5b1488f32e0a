"""The [metrics] listen value: ``host:port``, an IP literal (IPv6 in brackets);
and how long a scraper's connection may last."""

from __future__ import annotations

import ipaddress

__all__ = ["REQUEST_TIMEOUT", "parse_listen"]

REQUEST_TIMEOUT = 5.0  # seconds a client connection may last: its request and the answer


def parse_listen(value: str) -> tuple[str, int]:
    """(host, port) of ``value``; ValueError saying what is wrong. Host names
    are refused: the address bound is the one written, never a lookup's."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9400 or [::1]:9400)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        want: type[ipaddress.IPv4Address | ipaddress.IPv6Address] = ipaddress.IPv6Address
    else:
        want = ipaddress.IPv4Address
    try:
        want(host)
    except ValueError:
        hint = " (IPv6 goes in brackets)" if ":" in host and want is ipaddress.IPv4Address else ""
        raise ValueError(f"{host!r} in {value!r} is not an IP address{hint}") from None
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} in {value!r} is not 1-65535")
    return host, int(port_text)
