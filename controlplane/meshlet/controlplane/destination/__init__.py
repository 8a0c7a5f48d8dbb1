"""The destination service: endpoint sets and profiles streamed to proxies."""
