"""CDI (Container Device Interface) for container runtimes: ``spec`` builds
the spec of the tenants' devices (pure: one device per tenant and its GPU set,
the emulated nodes under /dev/vgpu at the container paths /dev/nvidia*, and
the createRuntime hook that binds the container's cgroup to the tenant and
the poststop hook that unbinds it), ``hook`` reads what those hooks are
handed (the OCI state) and the container's /proc/PID/cgroup, ``files`` writes and removes
the spec file, and ``keeper`` is the daemon's observer that keeps it current.
"""
