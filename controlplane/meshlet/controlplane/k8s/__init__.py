"""Kubernetes access: API clients, and the fake API server used by tests."""
