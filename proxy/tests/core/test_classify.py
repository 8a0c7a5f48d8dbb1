"""Response classification, as Linkerd labels `classification`."""

from __future__ import annotations

import pytest

from meshlet.proxy.core.classify import FAILURE, SUCCESS, classify


@pytest.mark.parametrize(
    ("status", "grpc_status", "expected"),
    [
        (200, None, SUCCESS),
        (204, "", SUCCESS),
        (302, None, SUCCESS),
        (404, None, SUCCESS),  # client errors are the client's: a success for the server
        (499, None, SUCCESS),
        (500, None, FAILURE),
        (503, None, FAILURE),
        (599, "0", FAILURE),
        (200, "0", SUCCESS),
        (200, "14", FAILURE),  # gRPC UNAVAILABLE inside an HTTP 200
        (200, "2", FAILURE),
    ],
)
def test_classify(status: int, grpc_status: str | None, expected: str) -> None:
    assert classify(status, grpc_status) == expected


def test_labels_are_linkerds() -> None:
    assert (SUCCESS, FAILURE) == ("success", "failure")
