"""The pure core: events in, decisions out.

``tenants`` (the tenant model and who an opener belongs to), ``cgroup_glob``
(the path-aware globs of its cgroup rules), ``ledger`` (per-tenant GPU
memory: reservations, charges, the RM object tree), the time-slice cores of
one GPU, ``runlist`` (the runlist planner: each channel group's timeslice,
the default mode) and ``tdma`` (the frame scheduler), ``shares`` (the share
of GPU time each tenant is entitled to), ``groups`` (the live channel
groups) and ``observers`` (the one way a subject tells others what changed).
No sockets, asyncio, clocks or files here, and no imports from the rest of
vgpud.
"""
