"""Follows the policy controller's `OutboundPolicies/Watch` stream for each outbound target the
proxy is asked to reach, over grpclib (TLS to the controller, verified by its name, as the
inbound `WatchPort` streams: the same MESHLET_PROXY_POLICY_SVC_ADDR and _NAME).

A target is a `HostPort`: an IP literal is asked for as `TrafficSpec.addr` (a connection to an
address, Linkerd's `OrigDstAddr`), a name as `TrafficSpec.authority` (`name:port`, what a
request named). Every message is decoded whole (`outbound_decode.decode_outbound`); one that
does not decode is logged and skipped, so the target keeps the policy it had, and while the
controller is unreachable the last policy stands (`watch.follow`: the loop every control-plane
stream shares). `Followed` holds one target's current policy for the router to read (None
until the controller has answered: the caller routes as it did without a policy).
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import AsyncGenerator
from typing import Any

from grpclib.client import Channel
from grpclib.config import Configuration

from meshlet.api import addr, outbound_grpc, outbound_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.client_policy import ClientPolicy
from meshlet.proxy.discovery.outbound_decode import decode_outbound
from meshlet.proxy.discovery.watch import Received, StreamStats, Watch, follow
from meshlet.proxy.tls.contexts import control_client_context

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
        trust_anchors_pem: str | None,
        workload: str,
        *,
        backoff: tuple[float, float] = (0.1, 5.0),
        rng: random.Random | None = None,
    ) -> None:
        if server_name and not trust_anchors_pem:
            raise ValueError(
                f"the policy controller is verified as {server_name!r} but no trust anchors "
                "are configured; set MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"
            )
        self.addr = addr
        self.server_name = server_name or None
        self._ssl = (
            control_client_context(trust_anchors_pem) if server_name and trust_anchors_pem else None
        )
        self.workload = workload
        self._backoff = backoff
        self._rng = rng or random.Random()
        self._channel: Channel | None = None
        self._stub: Any = None  # the generated grpclib stub is untyped
        self._closed = False
        self.stats = StreamStats()

    def watch(self, target: HostPort) -> AsyncGenerator[Received[ClientPolicy], None]:
        """Every policy the controller sends for `target`, across reconnections; never ends on
        its own."""
        source = f"the policy controller at {self.addr}"
        what = f"outbound policy Watch {target}"
        spec = traffic_spec(self.workload, target)
        backoff = Backoff(*self._backoff, self._rng)
        return follow(Watch(self._open, spec, what, source, log), decode_outbound, backoff,
                      self.stats)  # fmt: skip

    async def aclose(self) -> None:
        self._closed = True
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def _open(self) -> Any:
        if self._closed:
            raise RuntimeError("the outbound policy client is closed")
        if self._stub is None:
            config = Configuration(ssl_target_name_override=self.server_name)
            self._channel = Channel(*self.addr, ssl=self._ssl, config=config)
            self._stub = outbound_grpc.OutboundPoliciesStub(self._channel)
        return self._stub.Watch.open()


class Followed:
    """One target's current policy, kept up to date by `run()` (until cancelled). `version`
    counts the policies that changed it, so a reader recomputes only on change."""

    def __init__(self, client: WatchOutbound, target: HostPort) -> None:
        self.client = client
        self.target = target
        self.policy: ClientPolicy | None = None
        self.version = 0

    async def run(self) -> None:
        async for received in self.client.watch(self.target):
            if received.value == self.policy:
                continue
            self.policy = received.value
            self.version += 1
            log.info("outbound %s: policy %s (%s)", self.target, self.policy.meta,
                     self.policy.protocol.value)  # fmt: skip
