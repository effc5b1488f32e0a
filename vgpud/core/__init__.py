"""The pure core: events in, decisions out.

``tenants`` (the tenant model and who an opener belongs to), ``ledger``
(per-tenant GPU memory: reservations, charges, the RM object tree), ``tdma``
(the time-slice scheduler of one GPU), ``shares`` (the share of GPU time
each tenant is entitled to), ``groups`` (the live channel groups) and
``observers`` (the one way a subject tells others what changed). No sockets,
asyncio, clocks or files here, and no imports from the rest of vgpud.
"""
