"""Per-context latency from eBPF probes (bcc) on the vgpu module's tracepoints.

``layout`` mirrors ebpf/vgpu_latency.h (the histogram key the BPF program and
the daemon share); ``histograms`` is the pure part: log2 histograms, the
names of calls, and the book that folds per-context counts into per-tenant
histograms; ``render`` prints them as bcc's tools do; ``bcc_probes``
compiles and attaches ebpf/vgpu_latency.bpf.c and reads its maps;
``service`` runs that on the event loop at an interval and says why when
the probes are off. ``helper`` is vgpud-probes, the privileged
process that loads them for a daemon without CAP_BPF; ``remote`` is the
daemon's side of it and ``wire`` their messages. See docs/architecture.md
(Latency probes).
"""
