"""vgpud: node-local GPU sharing daemon (kernel upcall path, policy, admin).

The data path, in the order a call takes it: ``kernel`` (our module's
protocol: uapi mirror, codec, netlink channel) -> ``policy`` (upcall to
verdict: the Dispatcher and the policies, sans-I/O, reading NVIDIA's ABI
from ``nvidia``) -> ``core`` (pure decisions: tenants, memory ledger, the
runlist planner and the TDMA scheduler, channel groups). Around it:
``sched`` (the asyncio side of scheduling), ``admin`` (the Manager and its
D-Bus API), ``store`` (config, state, journal), ``host`` (OS glue),
``probes`` (eBPF latency probes), ``metrics`` (Prometheus), ``fsview`` (the
file view) and ``cdi`` (CDI specs for container runtimes). ``app`` makes and
wires them all; ``daemon`` runs the process; ``cli`` is vgpuctl;
``lograte`` bounds how often one kind of log line is written; ``wire`` is
the one frame format the daemon and its helpers (vgpud-probes,
vgpud-fsmount, vgpud-metrics) speak.
"""

__version__ = "0.1.0"
