"""OS glue: GPU inventory, cgroup lookup, sd_notify, another process's memory."""
