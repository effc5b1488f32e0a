"""TDMA scheduling of tenants on each GPU, actuated through channel groups.

    policy     SchedPolicy: wraps the quota policy, learns channel groups from
               RM_ALLOC / RM_FREE POST events and context closes (sans-I/O)
    groups     GroupTracker: the live groups, by handle, context and client
    service    SchedulerService: per GPU a vgpud.core.tdma.TdmaScheduler on
               timers, fed by the tracker, the Manager and an activity source
    actuator   turns groups on and off (the module's VGPU_CMD_SCHEDULE)
    activity   which tenants have work: nvsim's /proc counters, NVML, or none

See docs/architecture.md (Scheduling).
"""
