"""The one error type of a refused certification, carrying its gRPC status."""

from __future__ import annotations

import grpc


class CertifyError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
