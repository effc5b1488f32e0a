"""The latency probes on the event loop: load at start, read at an interval.

The compile and every map access run in a worker thread (bcc blocks); the
loop only folds the counts (vgpud.probes.histograms). ``status`` says what
the probes are doing, or why they are off, for the log and D-Bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from vgpud.probes.bcc_probes import (
    LatencyProbes,
    Probes,
    ProbesUnavailable,
    find_source,
    unavailable_reason,
)
from vgpud.probes.histograms import Histogram, LatencyBook
from vgpud.probes.remote import RemoteProbes, helper_reason

__all__ = ["ProbeService"]

log = logging.getLogger("vgpud.probes")


class ProbeService:
    """``tenant_of``: a context's tenant (None: unknown or closed);
    ``closed_tenant``: that of a recently closed context. ``make_probes``
    is given ``source``, the BPF source (found when None). ``helper``: load
    the probes in vgpud-probes, over that socket (RemoteProbes), instead."""

    def __init__(self, tenant_of: Callable[[int], str | None], *,
                 closed_tenant: Callable[[int], str | None] = lambda _: None,
                 enabled: bool = True,
                 interval: float = 1.0, source: Path | None = None,
                 reason: Callable[[], str | None] = unavailable_reason,
                 make_probes: Callable[[Path], Probes] = LatencyProbes,
                 helper: Path | None = None) -> None:
        if helper is not None:
            source, make_probes = helper, RemoteProbes
            reason = partial(helper_reason, helper)
        self._tenant_of = tenant_of
        self._closed_tenant = closed_tenant
        self._enabled = enabled
        self._interval = interval
        self._source = source
        self._reason = reason
        self._make_probes = make_probes
        self._probes: Probes | None = None
        # Being loaded: closed by stop, so that a load waiting on the helper
        # ends with it (the worker thread would hold up the daemon's exit).
        self._loading: Probes | None = None
        self._task: asyncio.Task[None] | None = None
        self.book = LatencyBook()
        self.status = "off: not started"
        self.attach_seconds: float | None = None
        self.dropped = 0  # events the BPF program could not count (a full map)

    @property
    def on(self) -> bool:
        return self.status.startswith("on")

    def start(self) -> None:
        """Check what the probes need and load them, in the background (the
        checks import bcc: seconds in a slow guest)."""
        if not self._enabled:
            self._off("disabled (probes.enabled = false, or --no-probes)")
            return
        self.status = "loading"
        self._task = asyncio.create_task(self._run(), name="latency probes")

    def _off(self, why: str) -> None:
        self.status = f"off: {why}"
        log.warning("latency probes off: %s", why)

    async def _run(self) -> None:
        t0 = time.monotonic()
        why = await asyncio.to_thread(self._reason)
        if why is not None:
            self._off(why)
            return
        try:
            source = self._source or find_source()
        except ProbesUnavailable as exc:
            self._off(str(exc))
            return
        probes = self._loading = self._make_probes(source)
        try:
            points = await asyncio.to_thread(probes.load)
        except ProbesUnavailable as exc:
            await asyncio.to_thread(probes.close)
            self._off(str(exc))
            return
        finally:
            self._loading = None
        self._probes = probes
        self.attach_seconds = time.monotonic() - t0
        self.status = "on: " + ", ".join(points)
        log.info("latency probes attached in %.1f s: %s", self.attach_seconds,
                 ", ".join(points))
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.read()
            except Exception:  # one bad read must not end the probes
                log.exception("reading the latency probes failed")

    async def read(self) -> None:
        """Fold the map into the book, trim closed contexts, follow reloads."""
        probes = self._probes
        if probes is None:
            return
        if await asyncio.to_thread(probes.stale):
            made = probes.maps_made
            if not await asyncio.to_thread(probes.reattach):
                if self.status != f"off: {probes.waiting}":
                    self.status = f"off: {probes.waiting}"
                    log.warning("latency probes: %s", self.status)
                return
            if probes.maps_made != made:  # a new helper's: it counts from zero
                self.book.new_map()
            self.status = "on: " + ", ".join(probes.attach_points)
            log.info("latency probes attached again: %s", ", ".join(probes.attach_points))
        counts = await asyncio.to_thread(probes.read)
        gone = self.book.update(counts, self._tenant_of, self._closed_tenant)
        if gone:
            await asyncio.to_thread(probes.delete, gone)
        dropped = await asyncio.to_thread(probes.dropped)
        if dropped > self.dropped:
            log.warning("latency probes: %d events not counted: the histogram map is full "
                        "(%d in all)", dropped - self.dropped, dropped)
        self.dropped = dropped

    def latency(self, tenant: str, kind: str = "") -> dict[tuple[str, str], Histogram]:
        return self.book.histograms(tenant, kind)

    async def stop(self) -> None:
        """Detach (the module is no longer pinned once this returns)."""
        loading = self._loading
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if loading is not None:
            await asyncio.to_thread(loading.close)
        if self._probes is not None:
            await asyncio.to_thread(self._probes.close)
            self._probes = None
        if self.on or self.status == "loading":
            self.status = "off: stopped"
