"""The tap controller: proxies' live request streams, merged for the CLI and the dashboard."""
