"""The session's real cluster (e2e/kit.py) as a fixture of the end-to-end suite."""

from e2e.kit import cluster

__all__ = ["cluster"]
