"""The web dashboard: server-rendered pages of the metrics API and a relayed live tap."""
