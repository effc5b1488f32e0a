"""What the daemon keeps on disk: config, runtime state, the journal."""
