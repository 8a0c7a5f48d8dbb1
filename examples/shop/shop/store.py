"""The store: a gRPC service (grpcio) keeping stock reservations in memory.

Its methods take and return JSON (no generated code): `Reserve` takes one unit of stock for an
order (not idempotent: each call takes one more), `Confirm` writes the order to a ledger that is
busy the first time each order is confirmed (UNAVAILABLE: try later), `Stock` says how many
units are reserved, and `Report` takes a slow path (300 ms).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent import futures
from typing import Any

import grpc

SERVICE = "shop.Store"
REPORT_SECONDS = 0.3


class Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reserved = 0
        self.confirmed: set[str] = set()
        self.tried: set[str] = set()

    def reserve(self, request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        with self.lock:
            self.reserved += 1
            return {"order": request["order"], "reserved": self.reserved}

    def confirm(self, request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        order = request["order"]
        with self.lock:
            first = order not in self.tried
            self.tried.add(order)
            if not first:
                self.confirmed.add(order)
        if first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the ledger is busy: try later")
        return {"order": order, "confirmed": True}

    def stock(self, request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        with self.lock:
            return {"reserved": self.reserved, "confirmed": len(self.confirmed)}

    def report(self, request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        time.sleep(REPORT_SECONDS)
        return self.stock(request, context)


def handler(store: Store) -> grpc.GenericRpcHandler:
    def unary(method: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=json.loads,
            response_serializer=lambda r: json.dumps(r).encode(),
        )

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Reserve": unary(store.reserve),
        "Confirm": unary(store.confirm),
        "Stock": unary(store.stock),
        "Report": unary(store.report),
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9090)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler(Store()),))
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
