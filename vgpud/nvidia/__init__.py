"""NVIDIA's kernel ABI, pure: ``escapes`` (ioctl numbers, classes, controls,
statuses) and ``layouts`` (params structs and their decoders into typed
calls, and the rewrites of the memory-info answers). Facts from NVIDIA's
open-gpu-kernel-modules; nothing here knows our module or our policies.
"""
