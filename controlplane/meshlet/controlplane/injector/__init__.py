"""The proxy injector: which pods get a proxy, the patch that adds it, and the webhook."""
