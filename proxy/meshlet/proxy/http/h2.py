"""The proxy's HTTP/2 engine (gRPC included): its entry points.

`serve_h2(conn, pool)` serves one accepted connection; `H2Pool` holds the upstream connections
(one multiplexed HTTP/2 connection per endpoint) and is made once by the application and passed
to every call. Each request's route, attempts and outcome are `attempts.Attempts`'s; the
engine's modules, top-down:

- `h2server`: the downstream side of a connection, its limits and its abuse guards;
- `h2stream`: one request relayed to an upstream stream and its response back;
- `h2client`, `h2pool`: upstream connections and the pool of them;
- `h2conn`: what both sides share (h2 set up for relaying, output batching, back-pressure);
- `h2headers`, `h2guard`, `h2hpack`: pure header checks, abuse accounting, and HPACK.
"""

from meshlet.proxy.http.h2guard import GuardLimits
from meshlet.proxy.http.h2pool import H2Pool
from meshlet.proxy.http.h2server import serve_h2

__all__ = ["GuardLimits", "H2Pool", "serve_h2"]
