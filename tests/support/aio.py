"""Waiting on an event loop in tests: poll a condition without blocking it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(what: str, ok: Callable[[], bool], timeout: float = 30) -> None:
    """Poll ``ok`` every 20 ms, letting the loop run, until true; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ok():
        assert loop.time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)
