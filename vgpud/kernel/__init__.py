"""Our kernel module's protocol: uapi mirror, struct codec, netlink channel."""
