"""C struct layouts described once, for `struct` packing and for layout tests.

A layout lists its fields in order with explicit padding, in native byte order
without implicit alignment (``=``), so Python offsets are exactly the ones the
format string spells out and a test can compare each of them with gcc's.
"""

from __future__ import annotations

import struct

__all__ = ["CStruct", "DecodeError"]


class DecodeError(ValueError):
    """Bytes that do not follow the layout they claim to.

    ``upcall_id`` is set when the message was an upcall whose id could still
    be read, so that the daemon can answer it instead of letting it time out.
    """

    def __init__(self, message: str, *, upcall_id: int | None = None) -> None:
        super().__init__(message)
        self.upcall_id = upcall_id


class CStruct:
    """A named C struct: ``(field, format)`` pairs; a ``None`` field is padding.

    An array field uses a repeat count (``"32I"``) and unpacks to that many values.
    """

    __slots__ = ("fields", "name", "offsets", "size", "struct")

    def __init__(self, name: str, *fields: tuple[str | None, str]) -> None:
        self.name = name
        self.fields = fields
        offsets: dict[str, int] = {}
        fmt = "="
        for field, code in fields:
            if field is not None:
                offsets[field] = struct.calcsize(fmt)
            fmt += code
        self.struct = struct.Struct(fmt)
        self.offsets = offsets
        self.size = self.struct.size

    def unpack(self, buf: bytes | memoryview, offset: int = 0) -> tuple:
        """Unpack exactly ``size`` bytes at ``offset``; DecodeError if short."""
        if len(buf) - offset < self.size:
            raise DecodeError(f"{self.name}: {len(buf) - offset} bytes, need {self.size}")
        return self.struct.unpack_from(buf, offset)

    def unpack_exact(self, buf: bytes | memoryview) -> tuple:
        """Unpack a buffer that must be exactly ``size`` bytes long."""
        if len(buf) != self.size:
            raise DecodeError(f"{self.name}: {len(buf)} bytes, expected {self.size}")
        return self.struct.unpack_from(buf)

    def __repr__(self) -> str:
        return f"CStruct({self.name!r}, size={self.size})"
