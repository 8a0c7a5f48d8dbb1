"""TLS for the proxy: contexts built from the issued certificate and the trust anchors
(`contexts`), and the TLS transport every mTLS connection runs on, which can half-close
(`transport`)."""
