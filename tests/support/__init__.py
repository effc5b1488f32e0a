"""Helpers shared by the test tiers, the benchmarks and the demo; no tests here.

Host tier (tests/unit): `fakekernel` plays the module's side of the netlink
family byte for byte; `daemon_world`, `quota_world` and `sched_world` wire
the daemon, the quota policy and the scheduler service to it (the last in
virtual time); `bus` runs a private system bus with the admin service;
`ledger_model` and `journal_files` hold the ledger's model check and the
journal's fixtures; `layouts` checks struct layouts against gcc.

VM tier (tests/vm): `guest` loads the modules and makes cgroups;
`nvclient` speaks NVIDIA's ioctls (on /dev/nvsim or /dev/vgpu) and `nvsim`
drives the simulator directly; `vgpu_genl` speaks the module's netlink
family raw, `calls` makes a tenant's calls, `responder` runs the C
responder (`c_responder.c`); `sched` and `tdma` observe scheduling; and
`vgpud_proc` runs the real daemon. `tenant_workload` and `tdma_workload`
are tenants as processes of their own (`python -m tests.support.X`, from
the repository root).
"""
