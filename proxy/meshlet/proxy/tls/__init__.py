"""TLS for the proxy: contexts built from the issued certificate and the trust anchors."""
