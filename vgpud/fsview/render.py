"""The text of each file of the view (pure): cgroup v2 conventions, one
value or one ``key value`` line per region, newline-terminated."""

from __future__ import annotations

from collections.abc import Callable

from vgpud.fsview.snapshot import Snapshot, TenantView

__all__ = ["TENANT_FILES", "WRITABLE", "render_gpus", "render_tenant_file"]


def _per_region(snap: Snapshot, values: tuple[int | None, ...]) -> str:
    return "".join(f"{gpu.region} {'max' if v is None else v}\n"
                   for gpu, v in zip(snap.gpus, values, strict=True))


def _capacity(snap: Snapshot, t: TenantView) -> str:
    return "".join(f"{gpu.region} {gpu.total}\n" for gpu in snap.gpus)


def _share(snap: Snapshot, t: TenantView) -> str:
    return "".join(
        f"{gpu.device} target={t.share.get(gpu.index, 0.0):.1f} "
        f"measured={t.measured.get(gpu.index, 0.0):.1f}\n"
        for gpu in snap.gpus)


def _contexts(snap: Snapshot, t: TenantView) -> str:
    def show(v: int | None) -> str:
        return "-" if v is None else str(v)

    return "".join(f"ctx={c.ctx} pid={show(c.pid)} tgid={show(c.tgid)} uid={show(c.uid)} "
                   f"gpu={show(c.gpu)} bytes={c.bytes}\n" for c in t.contexts)


Renderer = Callable[[Snapshot, TenantView], str]

TENANT_FILES: dict[str, Renderer] = {
    "dmem.max": lambda s, t: _per_region(s, t.limits),
    "dmem.current": lambda s, t: _per_region(s, t.current),
    "dmem.peak": lambda s, t: _per_region(s, t.peak),
    "dmem.capacity": _capacity,
    "gpu.weight": lambda s, t: f"{t.weight}\n",
    "gpu.max": lambda s, t: f"{'max' if t.cap is None else t.cap}\n",
    "gpu.priority": lambda s, t: f"{t.priority}\n",
    "gpu.share": _share,
    "contexts": _contexts,
}
WRITABLE = frozenset({"dmem.max", "gpu.weight", "gpu.max"})


def render_tenant_file(snap: Snapshot, tenant: str, name: str) -> bytes:
    """KeyError when there is no such tenant or file."""
    return TENANT_FILES[name](snap, snap.tenants[tenant]).encode()


def render_gpus(snap: Snapshot) -> bytes:
    """The top-level ``gpus``: one line per device; the name comes last (it has spaces)."""
    return "".join(f"{g.device} index={g.index} total={g.total} name={g.name}\n"
                   for g in snap.gpus).encode()
