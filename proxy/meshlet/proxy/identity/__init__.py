"""The proxy's identity: its key and CSR, and certificates from the identity service."""
