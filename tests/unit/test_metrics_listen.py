"""[metrics] listen: parsed by vgpud.metrics.listen, refused by the config loader."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpud.metrics.listen import parse_listen
from vgpud.store.config import ConfigError, parse_config


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("0.0.0.0:1", ("0.0.0.0", 1)),
    ("[::1]:65535", ("::1", 65535)),
])
def test_good_listen_values(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize(("value", "words"), [
    ("9400", "not host:port"),
    (":9400", "not host:port"),
    ("localhost:9400", "'localhost' in 'localhost:9400' is not an IP address"),
    ("::1:9400", "IPv6 goes in brackets"),
    ("127.0.0.1:0", "port '0'"),
    ("127.0.0.1:65536", "port '65536'"),
    ("127.0.0.1:-1", "port '-1'"),
    ("127.0.0.1:\uff19\uff14\uff10\uff10", "is not 1-65535"),  # fullwidth: isdigit(), not ASCII
    ("127.0.0.1:", "port ''"),
    ("[127.0.0.1]:9400", "not an IP address"),
])
def test_bad_listen_values(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_listen(value)


@settings(deadline=None)  # a loaded 2-core host is slow, not wrong
@given(st.ip_addresses(), st.integers(1, 65535))
def test_any_address_round_trips(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                                 port: int) -> None:
    text = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
    assert parse_listen(text) == (str(address), port)


@settings(deadline=None)  # a loaded 2-core host is slow, not wrong
@given(st.text(max_size=40))
def test_anything_parses_or_says_why(value: str) -> None:
    try:
        host, port = parse_listen(value)
    except ValueError as exc:
        assert str(exc)
    else:
        ipaddress.ip_address(host)
        assert 1 <= port <= 65535


def test_the_config_names_the_key() -> None:
    assert parse_config("").metrics.listen == "127.0.0.1:9400"
    assert parse_config("").metrics.enabled is False
    with pytest.raises(ConfigError) as bad:
        parse_config('[metrics]\nenabled = true\nlisten = "localhost:9400"\n')
    assert bad.value.key == "metrics.listen"
    assert "not an IP address" in bad.value.problem
    with pytest.raises(ConfigError) as number:
        parse_config("[metrics]\nlisten = 9400\n")
    assert number.value.key == "metrics.listen"
