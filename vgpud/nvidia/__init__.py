"""NVIDIA's kernel ABI, pure: ``escapes`` (ioctl numbers, classes, controls,
statuses), ``layouts`` (params structs and their decoders into typed calls,
the alloc params each class takes, and the rewrites of the memory-info
answers) and ``pages`` (what the driver rounds an allocation up to). Facts
from NVIDIA's open-gpu-kernel-modules and from traces of the real driver
(tests/data/traces/h200-*); nothing here knows our module or our policies.
"""
