"""OS glue: ``inventory`` (the GPUs: nvsim's or NVML's), ``cgroups`` (cgroup
paths from ids), ``systemd`` (sd_notify and the watchdog interval) and
``procmem`` (another process's memory, for the FB_GET_INFO list).
"""
