"""One call of the shop store's Stock by grpcio, as an app in a pod makes it: `OK`, or the
call's status and details (the target, e.g. `store.shop:9090`, is the first argument)."""

import sys

import grpc

with grpc.insecure_channel(sys.argv[1]) as channel:
    call = channel.unary_unary("/shop.Store/Stock")
    try:
        call(b"{}", timeout=5)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
