"""nvtrace: recorded NVIDIA driver calls (libnvtrace.so, beside this package) read,
checked and re-issued.

A development tool of the checkout, never installed: pyproject.toml ships
``vgpud*`` only, and nothing in vgpud imports this package (it imports vgpud).
Run from the repository root as ``python -m tools.nvtrace``.

fmt: the file format; calls: records as NVIDIA calls; check: the replay
check through vgpud's decoders and quota policy; reissue: the calls sent
again to a directory of nodes; nvsim_src: what kmod/nvsim models, read from
its sources in this checkout. See docs/nvtrace.md.
"""
