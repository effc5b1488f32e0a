"""The asyncio side of TDMA scheduling: ``service`` (SchedulerService: one
vgpud.core.tdma scheduler per GPU on timers, fed by the GroupTracker, the
Manager and an activity source), ``actuator`` (turns channel groups on and
off through the module's VGPU_CMD_SCHEDULE) and ``activity`` (which tenants
have work: nvsim's /proc counters, NVML, or none). The pure parts are in
vgpud.core; the policy that learns groups is vgpud.policy.sched. See
docs/architecture.md (Scheduling).
"""
