"""Our kernel module's protocol: ``uapi`` (the mirror of
include/uapi/linux/vgpu.h), ``cstruct`` (fixed layouts with ``struct``),
``codec`` (sans-I/O encode/decode of the generic netlink family) and
``channel`` (the asyncio netlink socket that carries upcalls and verdicts).
"""
