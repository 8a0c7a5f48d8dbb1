"""The policy controller: inbound server policies streamed to proxies."""
