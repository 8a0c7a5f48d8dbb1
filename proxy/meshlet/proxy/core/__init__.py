"""Pure decisions of the proxy: detection, balancing, classification (no I/O)."""
