"""The outbound side: where the pod's own connections go."""
