"""The inbound side: connections arriving for the pod's application."""
