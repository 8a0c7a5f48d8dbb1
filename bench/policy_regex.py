"""What the regular expressions of one policy can cost a proxy at the limits
`meshlet.api.pathregex` sets: the longest one request is held matching them, how long a
policy's arrival holds the event loop compiling them, and the memory they take.

    python -m bench.policy_regex [--requests N] [--quick]

- *Request*: for each hostile pattern family (patterns whose DFA cannot hold its states, so RE2
  falls back to its slowest engine, with a path that keeps every instruction alive) and path
  length, an outbound policy (HTTP/1 routes, decoded by the proxy's decoder, selected by its
  route table) and an inbound one (a Server's HTTP routes, decided as the inbound router does)
  whose routes use the pattern often enough to exhaust a request's budget; N requests with
  fresh random paths each (after one request to warm the policy up, and a garbage collection:
  the decoding's garbage is not the requests'); the longest and the median, in the thread's CPU
  time (wall time on a shared machine is the CPU time plus whatever else runs).
- *Arrival*: policies at the budget's edge (MAX_REGEXES distinct patterns whose programs sum to
  MAX_PROGRAM instructions, from the patterns that cost RE2 the most to compile), decoded as the
  proxy decodes an answer of the policy controller; the decode's CPU time.
- *Memory*: the process's resident memory before decoding the costliest-to-hold policy and
  after matching it against many random paths (every pattern's DFA cache filled).

Prints one JSON object. Nothing is asserted: docs/policy.md states the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, Final

from google.protobuf import duration_pb2

from meshlet.api import http_route_pb2, inbound_pb2, meta_pb2, net_pb2, outbound_pb2
from meshlet.api.pathregex import (
    CALL_COST,
    MAX_PROGRAM,
    MAX_REGEXES,
    REQUEST_WORK,
    WEIGHT_FLOOR,
    RegexBudgetExceeded,
    compile_path_regex,
)
from meshlet.proxy.core import authz
from meshlet.proxy.discovery.outbound_decode import MAX_ROUTES, decode_outbound
from meshlet.proxy.discovery.policy_decode import MAX_ROUTES as MAX_INBOUND_ROUTES
from meshlet.proxy.discovery.policy_decode import decode_server

OB = outbound_pb2
HR = OB.HttpRoute
# (pattern, the alphabet of the paths that keep its instructions alive), each a family of RE2's
# slowest cases found by measurement (bench history in docs/policy.md)
HOSTILE: Final = (
    (r"/[ab]*a[ab]{%d}", "ab"),
    (r"/(?:[ab]*a){%d}c", "a"),
    (r"/(?:a|b|ab|ba)*a(?:a|b){%d}", "ab"),
    (r"/.*a.{%d}", "ab"),
    (r"(?i)/[ab]*a[ab]{%d}", "aB"),
    (r"/[^x]*a[^x]{%d}", "a\u00e9"),
)
SIZES: Final = (12, 20, 50, 200, 800)
LENGTHS: Final = (256, 1024, 4096, 8192)
# Patterns that cost RE2 the most to compile per instruction (Unicode classes, case folding)
COSTLY_COMPILES: Final = (r"\pL{3}", r"(?i)\pL{2}\pN", r"(?i)\pL\pL", r"\PL\PN")


def _seconds(value: float) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=int(value), nanos=round(value % 1 * 1e9))


def _backend() -> OB.Backend:
    return OB.Backend(
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="core", kind="Service", name="web", namespace="shop", port=80)),
        balancer=OB.Backend.BalanceP2c(
            discovery=OB.Backend.EndpointDiscovery(dst=OB.Backend.EndpointDiscovery.DestinationGet(
                path="web.shop.svc.cluster.local:80")),
            peak_ewma=OB.Backend.BalanceP2c.PeakEwma(default_rtt=_seconds(0.03),
                                                     decay=_seconds(10)),
        ),
        queue=OB.Queue(capacity=100, failfast_timeout=_seconds(3)),
    )  # fmt: skip


def _resource(kind: str, name: str) -> meta_pb2.Metadata:
    return meta_pb2.Metadata(resource=meta_pb2.Resource(
        group="gateway.networking.k8s.io", kind=kind, name=name, namespace="shop"))  # fmt: skip


def _match(pattern: str) -> http_route_pb2.HttpRouteMatch:
    return http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(regex=pattern))


def outbound_policy(patterns: list[str]) -> OB.OutboundPolicy:
    """A Service port's HTTP/1 policy: one route per pattern, one rule matching it."""
    first = HR.Distribution(first_available=HR.Distribution.FirstAvailable(
        backends=[HR.RouteBackend(backend=_backend())]))  # fmt: skip
    routes = [
        HR(metadata=_resource("HTTPRoute", f"r{i}"),
           rules=[HR.Rule(matches=[_match(p)], backends=first)])
        for i, p in enumerate(patterns)
    ]  # fmt: skip
    return OB.OutboundPolicy(
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="core", kind="Service", name="web", namespace="shop", port=80)),
        protocol=OB.ProxyProtocol(http1=OB.ProxyProtocol.Http1(routes=routes)),
    )  # fmt: skip


def inbound_policy(patterns: list[str]) -> inbound_pb2.Server:
    """A Server's HTTP/1 policy: one route per pattern, every client allowed."""
    everyone = inbound_pb2.Authz(
        networks=[inbound_pb2.Network(net=net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv4=0)))],
        authentication=inbound_pb2.Authn(
            unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()),
        labels={"name": "everyone"},
    )  # fmt: skip
    routes = [
        inbound_pb2.HttpRoute(metadata=_resource("HTTPRoute", f"r{i}"),
                              rules=[inbound_pb2.HttpRoute.Rule(matches=[_match(p)])])
        for i, p in enumerate(patterns)
    ]  # fmt: skip
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(http1=inbound_pb2.ProxyProtocol.Http1(routes=routes)),
        authorizations=[everyone],
        labels={"name": "web"},
    )


def _cpu(call: Callable[[str], object], path: str) -> float:
    """The thread's CPU time `call(path)` takes (a refused request is a request too)."""
    started = time.thread_time()
    with contextlib.suppress(RegexBudgetExceeded):
        call(path)
    return time.thread_time() - started


def _routers(pattern: str, uses: int) -> dict[str, Callable[[str], object]]:
    """How the outbound and the inbound side route a GET of a path, by policies whose every
    route matches `pattern`."""
    policy = decode_outbound(outbound_policy([pattern] * min(uses, MAX_ROUTES)))
    table = policy.table(policy.http1, False)
    server = decode_server(inbound_policy([pattern] * min(uses, MAX_INBOUND_ROUTES)))
    permits = authz.Client(ipaddress.ip_address("10.0.0.1"), None, False).permits(server)

    def outbound(path: str) -> object:
        return table.select_parts("web", "GET", path, ())

    def inbound(path: str) -> object:
        return authz.decide(permits, "GET", path, lambda: authz.request("web", "GET", path, ()))

    return {"outbound": outbound, "inbound": inbound}


def request_stall(
    requests: int, lengths: tuple[int, ...], sizes: tuple[int, ...]
) -> dict[str, Any]:
    rng = random.Random(1)
    worst: dict[str, Any] = {"seconds": 0.0}
    rows: list[dict[str, Any]] = []
    for family, alphabet in HOSTILE:
        for size in sizes:
            try:
                program = compile_path_regex(family % size).program
            except ValueError:
                continue  # over a pattern's memory
            for length in lengths:
                pattern = family % size
                uses = REQUEST_WORK // ((program + WEIGHT_FLOOR) * length + CALL_COST) + 2
                for side, route in _routers(pattern, uses).items():
                    gc.collect()  # the decoding's garbage is not the requests' to collect
                    route("/" + alphabet * 4)  # warm: the first match builds what is shared
                    times = []
                    for _ in range(requests):
                        path = "/" + "".join(rng.choice(alphabet) for _ in range(length - 1))
                        times.append(_cpu(route, path))
                    row = {"side": side, "pattern": pattern, "program": program,
                           "path": length, "uses": uses, "max": max(times),
                           "median": statistics.median(times)}  # fmt: skip
                    rows.append(row)
                    if row["max"] > worst["seconds"]:
                        worst = {"seconds": row["max"], **row}
    rows.sort(key=lambda r: -r["max"])
    return {"worst": worst, "top": rows[:8]}


def _edge(costly: str, tag: str) -> list[str]:
    """MAX_REGEXES distinct patterns whose programs sum to at most MAX_PROGRAM: as many copies
    of `costly` as fit, then small hostile ones. Each carries `tag` and its index (fixed widths:
    the programs are the same whatever the tag)."""
    patterns: list[str] = []
    total = 0
    while len(patterns) < MAX_REGEXES:
        candidate = f"{costly}(?:{tag}{len(patterns):04d})?"
        program = compile_path_regex(candidate).program
        if total + program > MAX_PROGRAM - 60 * (MAX_REGEXES - len(patterns) - 1):
            break
        patterns.append(candidate)
        total += program
    while len(patterns) < MAX_REGEXES:
        candidate = f"/[ab]*a[ab]{{{20:02d}}}(?:{tag}{len(patterns):04d})?"
        patterns.append(candidate)
        total += compile_path_regex(candidate).program
    assert total <= MAX_PROGRAM, (costly, total)
    return patterns


def arrival() -> dict[str, Any]:
    """Decoding policies at the budget's edge, made of the costliest patterns to compile."""
    out = {}
    for costly in (*COSTLY_COMPILES, r"/(?i)[ab]*a[ab]{20}"):
        # sized with one tag, decoded with another: google-re2 caches what it compiles
        fresh = [p.replace("(?:q", "(?:w") for p in _edge(costly, "q")]
        message = outbound_policy(fresh)
        started = time.thread_time()
        decode_outbound(message)
        out[costly] = time.thread_time() - started
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory(paths: int) -> dict[str, Any]:
    rng = random.Random(2)
    before = _rss()
    patterns = [f"/[ab]*a[ab]{{40}}(?:m{i}n)?" for i in range(MAX_REGEXES)]
    policy = decode_outbound(outbound_policy(patterns))
    table = policy.table(policy.http1, False)
    decoded = _rss()
    for _ in range(paths):
        path = "/" + "".join(rng.choice("ab") for _ in range(300))
        with contextlib.suppress(RegexBudgetExceeded):
            table.select_parts("web", "GET", path, ())
    return {"before": before, "decoded": decoded - before, "matched": _rss() - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and lengths")
    args = parser.parse_args()
    lengths = (1024, 8192) if args.quick else LENGTHS
    sizes = (20, 200) if args.quick else SIZES
    limits = {"request_work": REQUEST_WORK, "max_regexes": MAX_REGEXES, "max_program": MAX_PROGRAM}
    report = {
        "limits": limits,
        "request": request_stall(args.requests, lengths, sizes),
        "arrival": arrival(),
        "memory": memory(200 if args.quick else 2000),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
