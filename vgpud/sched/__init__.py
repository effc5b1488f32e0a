"""The asyncio side of scheduling: ``service`` (SchedulerService: one core per
GPU on timers, a vgpud.core.runlist planner or a vgpud.core.tdma scheduler as
``modes`` has them, fed by the GroupTracker, the Manager and an activity
source), ``actuator`` (turns channel groups on and off, sets their timeslices
and preempts them through the module's VGPU_CMD_SCHEDULE) and ``activity`` (which tenants
have work: nvsim's /proc counters, NVML, or none). The pure parts are in
vgpud.core; the policy that learns groups is vgpud.policy.sched. See
docs/scheduling.md.
"""
