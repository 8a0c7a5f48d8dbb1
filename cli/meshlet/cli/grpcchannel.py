"""A gRPC channel to a control-plane service for the diagnostics commands: TLS verified
against trust anchors for the service's identity, or plaintext (the local mesh's, a test's)."""

from __future__ import annotations

from typing import Any


def control_channel(target: str, ca: bytes | None, server_name: str) -> Any:
    """A channel to `target` (no HTTP proxy); TLS verified against `ca` for `server_name` when
    `ca` is given, else plaintext."""
    import grpc

    options: list[tuple[str, Any]] = [("grpc.enable_http_proxy", 0)]
    if ca is None:
        return grpc.insecure_channel(target, options=options)
    options.append(("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.secure_channel(target, credentials, options=options)
