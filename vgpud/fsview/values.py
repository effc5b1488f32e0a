"""What a write to a file of the view means (pure): the Manager changes it
asks for, or ValueError (EINVAL) saying what is wrong.

A write is one whole value, at offset 0, at most MAX_WRITE bytes of ASCII
with no control characters but newlines, and one trailing newline at most
per line (``echo`` adds one). Ranges (weight 1..1000, cap 1..100, a memory
limit above 0) are checked by the Manager, as for D-Bus.

dmem.max takes the dmem controller's ``<region> <bytes|max>`` lines, or a
bare ``<bytes|max>``. vgpud has one memory limit per tenant that applies on
each of its GPUs, so every line must carry the same value; it sets that limit.
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["MAX_WRITE", "parse_write"]

MAX_WRITE = 4096
_NUMBER = re.compile(r"[0-9]{1,20}")
_LINE = re.compile(r"[\x20-\x7e]*")


def _text(data: bytes) -> list[str]:
    if len(data) > MAX_WRITE:
        raise ValueError(f"a value is at most {MAX_WRITE} bytes, not {len(data)}")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("a value is ASCII text") from None
    if text.endswith("\n"):
        text = text[:-1]
    lines = [line.strip() for line in text.split("\n")]
    if not all(_LINE.fullmatch(line) for line in lines):
        raise ValueError("a value has no control characters (NUL, tab, ...)")
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError("empty value")
    return lines


def _one(data: bytes) -> str:
    lines = _text(data)
    if len(lines) != 1:
        raise ValueError("one value per write")
    return lines[0]


def _number_or_max(word: str) -> int | None:
    if word == "max":
        return None
    if not _NUMBER.fullmatch(word):
        raise ValueError(f"{word[:40]!r} is not a decimal number or max")
    return int(word)


def _dmem_max(data: bytes, regions: Collection[str]) -> dict[str, object]:
    lines = _text(data)
    values: set[int | None] = set()
    for line in lines:
        words = line.split()
        if len(words) == 1 and len(lines) == 1:
            values.add(_number_or_max(words[0]))
            continue
        if len(words) != 2:
            raise ValueError("dmem.max takes '<region> <bytes|max>' lines")
        region, value = words
        if region not in regions:
            raise ValueError(f"no region {region[:80]!r}")
        values.add(_number_or_max(value))
    if len(values) != 1:
        raise ValueError("vgpud has one memory limit per tenant: give every region the same")
    return {"memory": values.pop()}


def parse_write(name: str, data: bytes, regions: Collection[str]) -> dict[str, object]:
    """The Manager.update_tenant changes a write of ``data`` to file ``name``
    asks for; ``regions``: the dmem region names of the inventory."""
    if name == "dmem.max":
        return _dmem_max(data, regions)
    if name == "gpu.weight":
        word = _one(data)
        if not _NUMBER.fullmatch(word):
            raise ValueError(f"{word[:40]!r} is not a decimal number")
        return {"weight": int(word)}
    if name == "gpu.max":
        return {"cap": _number_or_max(_one(data))}
    raise ValueError(f"{name} is read-only")
