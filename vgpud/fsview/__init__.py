"""The cgroup-style file view of the daemon's state (a FUSE mount, mfusepy).

``snapshot`` (immutable views the event loop publishes), ``render`` (the
files' text) and ``values`` (what a write means) are pure. ``ops`` is the
mfusepy adapter that serves them in a FUSE thread; ``service`` runs it from
the event loop (publishes snapshots, applies writes through the Manager);
``peaks`` keeps dmem.peak on file across restarts;
``mountfd`` and ``helper`` split the mount off to a small privileged
program (vgpud-fsmount) so the deciding daemon needs no CAP_SYS_ADMIN.
See docs/architecture.md (File view).
"""
