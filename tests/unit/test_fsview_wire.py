"""vgpud-fsmount's messages (vgpud.fsview.mountfd, .helper): vgpud.wire
frames, their JSON bodies pinned, and anything else refused."""

from __future__ import annotations

import pytest

from vgpud.fsview.helper import Refused, parse_request
from vgpud.fsview.mountfd import REPLY_MAX, REQUEST_MAX, decode_reply, encode_reply
from vgpud.wire import HEADER_SIZE, WireError, body_length, encode, frame


def test_the_messages_are_pinned() -> None:
    assert frame(encode({"op": "mount"}), REQUEST_MAX) == b'VGW\x01\x0e\x00\x00\x00{"op":"mount"}'
    assert encode_reply(True, "/run/vgpud/fs") == b'{"status":"ok","mountpoint":"/run/vgpud/fs"}'
    assert encode_reply(False, "no") == b'{"status":"err","text":"no"}'


def test_requests_from_the_daemon_read_in_the_helper() -> None:
    out = frame(encode({"op": "umount"}), REQUEST_MAX)
    assert body_length(out[:HEADER_SIZE], REQUEST_MAX) == len(out) - HEADER_SIZE
    assert parse_request(out[HEADER_SIZE:], []) == "umount"
    assert parse_request(encode({"op": "mount"}), [5]) == "mount"


@pytest.mark.parametrize(("body", "fds", "says"), [
    (b'{"op":"mount"}', [], "mount takes one descriptor, not 0"),
    (b'{"op":"mount"}', [5, 6], "mount takes one descriptor, not 2"),
    (b'{"op":"umount"}', [5], "umount takes none, not 1"),
    (b'{"op":"mount /etc"}', [], "unknown request 'mount /etc'"),
    (b"mount\n", [5], "malformed request"),
    (b'{"op":"mount","path":"/etc"}', [5], "malformed request"),
    (b'{"op":["mount"]}', [5], "malformed request"),
    (b"", [], "malformed request"),
])
def test_other_requests_are_refused(body: bytes, fds: list[int], says: str) -> None:
    with pytest.raises(Refused, match=says):
        parse_request(body, fds)


def test_replies_round_trip_and_bad_ones_are_refused() -> None:
    assert decode_reply(encode_reply(True, "/mnt/é")) == (True, "/mnt/é")
    assert decode_reply(encode_reply(False, "x" * 5000)) == (False, "x" * 1024)
    assert len(encode_reply(True, "\U0001f600" * 1024)) <= REPLY_MAX  # PATH_MAX, escaped
    for bad in (b"OK /mnt", b'{"status":"ok"}', b'{"status":"ok","mountpoint":1}',
                b'{"status":"err","mountpoint":"/"}', b'{"status":"fine","text":""}',
                b'{"status":"ok","mountpoint":"/","text":""}'):
        with pytest.raises(WireError):
            decode_reply(bad)
