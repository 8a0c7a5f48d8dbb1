"""meshlet control plane: destination, identity and proxy-injector."""
