"""The handles the daemon names objects with (vgpud.policy.handles)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.support.fakekernel import FAMILY, upcall_msg
from vgpud.kernel import codec
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED, Escape
from vgpud.policy.handles import GENERATED_HANDLES, name_handle, new_handle, with_handle

FIRST, COUNT = GENERATED_HANDLES


@given(st.integers(0, 2**64 - 1), st.sets(st.integers(0, 64)))
def test_a_named_handle_is_free_and_in_range(upcall_id: int, taken_offsets: set[int]) -> None:
    taken = {FIRST + (upcall_id + i) % COUNT for i in taken_offsets}
    handle = name_handle(upcall_id, taken.__contains__)
    assert FIRST <= handle < FIRST + COUNT and handle not in taken


def test_the_range_is_above_rms_own() -> None:
    assert FIRST == 0xCAF00000 + 0x80000 and FIRST + COUNT <= 2**32


def test_every_handle_taken_still_names_one() -> None:
    assert FIRST <= name_handle(5, lambda h: True) < FIRST + COUNT


def _upcall(nr: int, params: bytes) -> codec.Upcall:
    (msg,) = codec.decode_datagram(upcall_msg(params, nr=nr), FAMILY)
    assert isinstance(msg, codec.Upcall)
    return msg


def test_with_handle_rewrites_only_the_new_handle() -> None:
    for layout in (L.NVOS21, L.NVOS64):
        params = bytes(range(layout.size))
        named = with_handle(_upcall(Escape.RM_ALLOC, params), 0xCAF80007)
        assert new_handle(Escape.RM_ALLOC, named) == 0xCAF80007
        at = layout.offsets["hObjectNew"]
        assert named[:at] + named[at + 4:] == params[:at] + params[at + 4:]


def test_with_handle_provides_a_vid_heap_handle() -> None:
    values = [0] * 28
    values[:3] = [1, 2, 2]
    values[11] = 0x80  # other flags stay
    named = with_handle(_upcall(Escape.RM_VID_HEAP_CONTROL, L.NVOS32.struct.pack(*values)),
                        0xCAF80009)
    got = L.NVOS32.struct.unpack(named)
    assert got[9] == 0xCAF80009 and got[11] == 0x80 | NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED
