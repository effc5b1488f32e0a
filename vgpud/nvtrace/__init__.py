"""nvtrace: recorded NVIDIA driver calls (tools/nvtrace) read, checked and re-issued.

fmt: the file format; calls: records as NVIDIA calls; check: the replay
check through vgpud's decoders and quota policy; reissue: the calls sent
again to a directory of nodes. See docs/nvtrace.md.
"""
