"""Response classification (pure): whether a response counts as a success, as Linkerd's.

A response is a failure when its HTTP status is 5xx, or when it carries a `grpc-status` other
than `0`; everything else (4xx included) is a success. The result is the `classification` label
of `response_total` and `response_latency_ms`.
"""

from __future__ import annotations

from typing import Final

SUCCESS: Final = "success"
FAILURE: Final = "failure"


def classify(status: int, grpc_status: str | None) -> str:
    """`success` or `failure` for a response with `status` and, for gRPC, its `grpc-status`
    (None or "" when absent, as for plain HTTP)."""
    if status >= 500:
        return FAILURE
    if grpc_status and grpc_status != "0":
        return FAILURE
    return SUCCESS
