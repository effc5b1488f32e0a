"""The pure core: tenants, the memory ledger, the TDMA scheduler.

Events in, decisions out: no sockets, asyncio, clocks or files here, and no
imports from vgpud.kernel, vgpud.admin, vgpud.probes or vgpud.daemon.
"""
