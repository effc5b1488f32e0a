"""What the driver rounds a memory allocation's size up to.

NVOS32_ATTR_PAGE_SIZE (attr 24:23) and NVOS32_ATTR2_PAGE_SIZE_HUGE (attr2
21:20), nvos.h, name the page size an allocation asks for; a power-of-two
alignment above it rounds further. libcuda asks for the default page size
with a 2 MiB alignment (driver 580.159.04, H200), so its allocations are
made, and charged, in 2 MiB steps (docs/hardware.md).
"""

from __future__ import annotations

__all__ = ["PAGE_SIZE", "granule", "page_round"]

PAGE_SIZE = 4096
_BIG_PAGE, _HUGE_PAGES = 64 << 10, {0: 2 << 20, 1: 2 << 20, 2: 512 << 20, 3: 256 << 30}


def page_round(size: int, granule: int = PAGE_SIZE) -> int:
    return -(-size // granule) * granule


def granule(attr: int, attr2: int, alignment: int) -> int:
    """What the driver rounds an allocation's size up to: its page size (BIG:
    64 KiB; HUGE: 2 MiB, 512 MiB or 256 GiB by attr2; else 4 KiB), or a larger
    power-of-two alignment. A reservation of the size rounded so fits what the
    driver makes; the driver's truth settles the charge (a GPU's big pages may
    be 128 KiB, a default page size may be chosen larger)."""
    match attr >> 23 & 3:
        case 2:
            page = _BIG_PAGE
        case 3:
            page = _HUGE_PAGES[attr2 >> 20 & 3]
        case _:
            page = PAGE_SIZE
    if alignment > page and not alignment & (alignment - 1):
        return alignment
    return page
