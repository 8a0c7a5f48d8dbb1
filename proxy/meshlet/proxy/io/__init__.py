"""The proxy's socket shells: listeners, detection peeks, relays."""
