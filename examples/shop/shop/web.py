"""web: the shop's HTTP API (FastAPI), calling the store over gRPC (grpcio) by its Service's
name, as an app in a cluster does; the mesh carries both hops.

POST /orders/{order} reserves a unit for the order, then confirms it (503 when the ledger is
busy: the client may place the order again); GET /stock and GET /report read the store (the
report takes the store's slow path).
"""

from __future__ import annotations

import json
import os
from typing import Any

import grpc
from fastapi import FastAPI, HTTPException

app = FastAPI(title="shop web")
_channel = grpc.insecure_channel(os.environ.get("STORE_ADDR", "store:9090"))


def call(method: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    stub = _channel.unary_unary(
        f"/shop.Store/{method}",
        request_serializer=lambda r: json.dumps(r).encode(),
        response_deserializer=json.loads,
    )
    try:
        answer: dict[str, Any] = stub(request, timeout=timeout)
    except grpc.RpcError as exc:
        status = 503 if exc.code() is grpc.StatusCode.UNAVAILABLE else 502
        raise HTTPException(status, f"store: {exc.code().name}: {exc.details()}") from None
    return answer


@app.post("/orders/{order}", status_code=201)
def place(order: str) -> dict[str, Any]:
    reserved = call("Reserve", {"order": order})
    call("Confirm", {"order": order})
    return {"order": order, "reserved": reserved["reserved"], "pod": os.environ.get("POD_NAME")}


@app.get("/stock")
def stock() -> dict[str, Any]:
    return call("Stock", {})


@app.get("/report")
def report() -> dict[str, Any]:
    return call("Report", {})
