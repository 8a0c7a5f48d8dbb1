"""The meshlet sidecar proxy."""
