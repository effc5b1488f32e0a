"""OS glue: ``inventory`` (the GPUs: nvsim's or NVML's), ``cgroups`` (cgroup
paths from ids), ``processes`` (a process's start time and the boot id, which
make a pid binding name one process) and ``systemd`` (sd_notify and the
watchdog interval). The daemon never reads or writes a tenant's memory:
what it must see of a call, the module copies in the caller's context.
"""
