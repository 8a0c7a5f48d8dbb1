"""Follows the policy controller's `OutboundPolicies/Watch` stream for each outbound target the
proxy is asked to reach, over grpclib (TLS to the controller, verified by its name, as the
inbound `WatchPort` streams: the same MESHLET_PROXY_POLICY_SVC_ADDR and _NAME).

A target is a `HostPort`: an IP literal is asked for as `TrafficSpec.addr` (a connection to an
address, Linkerd's `OrigDstAddr`), a name as `TrafficSpec.authority` (`name:port`, what a
request named). Every message is decoded whole (`outbound_decode.decode_outbound`); one that
does not decode is logged and skipped, so the target keeps the policy it had, and while the
controller is unreachable the last policy stands (`watch.follow`: the loop every control-plane
stream shares). `Followed` holds one target's current policy for the router to read (None
until the controller has answered: the caller waits for that answer, up to a bound).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import AsyncGenerator, Callable
from typing import Any

from grpclib.client import Channel

from meshlet.api import addr, outbound_grpc, outbound_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.client_policy import ClientPolicy
from meshlet.proxy.discovery.outbound_decode import decode_outbound
from meshlet.proxy.discovery.watch import ControlChannel, Received, StreamStats, Watch, follow
from meshlet.proxy.identity.anchors import TrustAnchors

log = logging.getLogger(__name__)


def traffic_spec(workload: str, target: HostPort) -> outbound_pb2.TrafficSpec:
    """What the controller is asked: by address for an IP literal, else by authority."""
    try:
        ip = ipaddress.ip_address(target.host)
    except ValueError:
        return outbound_pb2.TrafficSpec(source_workload=workload, authority=str(target))
    return outbound_pb2.TrafficSpec(source_workload=workload,
                                    addr=addr.tcp_to_proto(ip, target.port))  # fmt: skip


class WatchOutbound:
    """`Watch` streams to one policy controller, sharing one HTTP/2 channel (opened on first
    use: it needs the running loop). `aclose()` closes it; cancel the streams' consumers first.
    `stats` says how the streams are doing."""

    def __init__(
        self,
        addr: HostPort,
        server_name: str | None,
        trust_anchors: str | TrustAnchors | None,
        workload: str,
        *,
        backoff: tuple[float, float] = (0.1, 5.0),
        rng: random.Random | None = None,
    ) -> None:
        self._control = ControlChannel(addr, server_name, trust_anchors,
                                       "the policy controller")  # fmt: skip
        self.addr = addr
        self.workload = workload
        self._backoff = backoff
        self._rng = rng or random.Random()
        self.stats = StreamStats()

    def watch(
        self, target: HostPort, failed: Callable[[], None] = lambda: None
    ) -> AsyncGenerator[Received[ClientPolicy], None]:
        """Every policy the controller sends for `target`, across reconnections (`failed`:
        told of each failed stream); never ends on its own."""
        what = f"outbound policy Watch {target}"
        spec = traffic_spec(self.workload, target)
        backoff = Backoff(*self._backoff, self._rng)
        watch = Watch(self._control, _open, spec, what, log)
        return follow(watch, decode_outbound, backoff, self.stats, failed=failed)

    async def aclose(self) -> None:
        self._control.close()


def _open(channel: Channel) -> Any:
    return outbound_grpc.OutboundPoliciesStub(channel).Watch.open()


class Followed:
    """One target's current policy, kept up to date by `run()` (until cancelled). `version`
    counts the policies that changed it, so a reader recomputes only on change. `settled` is
    set once the controller has answered, with a policy or by failing the stream (a target it
    does not know), or once a request gave up waiting for it, so a first request waits for the
    answer, never for a retry, and a silent controller holds up one wait, not every request."""

    def __init__(self, client: WatchOutbound, target: HostPort) -> None:
        self.client = client
        self.target = target
        self.policy: ClientPolicy | None = None
        self.version = 0
        self.settled = asyncio.Event()

    async def run(self) -> None:
        async for received in self.client.watch(self.target, self.settled.set):
            self.settled.set()
            if received.value == self.policy:
                continue
            self.policy = received.value
            self.version += 1
            log.info("outbound %s: policy %s (%s)", self.target, self.policy.meta,
                     self.policy.protocol.value)  # fmt: skip
