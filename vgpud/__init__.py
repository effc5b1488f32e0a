"""vgpud: node-local GPU sharing daemon (kernel upcall path, policy, admin)."""

__version__ = "0.1.0"
