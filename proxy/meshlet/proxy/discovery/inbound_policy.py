"""Follows the policy controller's `WatchPort` stream for each of the pod's inbound ports, over
grpclib (TLS to the controller, verified by its name), reconnecting with jittered backoff.

`Policies.get(port)` is what the inbound stack reads, per connection and per request: the port's
current `ServerPolicy`. Until the controller has answered for a port, and for ports it does not
watch, that is the default policy (`deny` fails closed). When the stream breaks the last policy
stands; a message that does not decode is logged and skipped, the policy before it kept (the
loop is `watch.follow`, shared with the destination and outbound streams). Each
policy published gets a new `version`, so that a connection recomputes what it precomputed only
when the policy changed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Mapping
from typing import Any

from grpclib.client import Channel

from meshlet.api import inbound_grpc, inbound_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.authz import ServerPolicy
from meshlet.proxy.discovery.policy_decode import decode_server
from meshlet.proxy.discovery.watch import ControlChannel, StreamStats, Watch, follow
from meshlet.proxy.identity.anchors import TrustAnchors

log = logging.getLogger(__name__)


class Policies:
    """The current policy of every inbound port (a plain dict read: cheap per request)."""

    def __init__(self, default: ServerPolicy, ports: Mapping[int, ServerPolicy] | None = None):
        self._versions = itertools.count(1)
        self.default = self._stamped(default)
        self._ports: dict[int, ServerPolicy] = {}
        for port, policy in (ports or {}).items():
            self.set(port, policy)

    def get(self, port: int) -> ServerPolicy:
        return self._ports.get(port, self.default)

    def set(self, port: int, policy: ServerPolicy) -> ServerPolicy:
        stamped = self._ports[port] = self._stamped(policy)
        return stamped

    def _stamped(self, policy: ServerPolicy) -> ServerPolicy:
        object.__setattr__(policy, "version", next(self._versions))  # frozen, but new
        return policy


class PolicyWatcher:
    """One WatchPort stream per port in `ports`, into `policies`. `run()` runs until cancelled;
    `first_answers` says how many ports have heard from the controller."""

    def __init__(
        self,
        policies: Policies,
        addr: HostPort,
        server_name: str | None,
        trust_anchors: str | TrustAnchors | None,
        workload: str,
        ports: tuple[int, ...],
        *,
        backoff: tuple[float, float] = (0.1, 5.0),
        rng: random.Random | None = None,
    ) -> None:
        self.policies = policies
        self.addr = addr
        self._control = ControlChannel(addr, server_name, trust_anchors,
                                       "the policy controller")  # fmt: skip
        self.workload = workload
        self.ports = ports
        self._backoff = backoff
        self._rng = rng or random.Random()
        self.answered: set[int] = set()
        self.stats = StreamStats()

    @property
    def failures(self) -> int:
        return self.stats.failures

    @property
    def last_error(self) -> str | None:
        return self.stats.last_error

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                for port in self.ports:
                    tasks.create_task(self._follow(port), name=f"policy watch :{port}")
        finally:
            self._control.close()

    async def _follow(self, port: int) -> None:
        request = inbound_pb2.PortSpec(workload=self.workload, port=port)
        watch = Watch(self._control, _watch_port, request, f"WatchPort :{port}", log)
        backoff = Backoff(*self._backoff, self._rng)
        async for received in follow(watch, decode_server, backoff, self.stats):
            self._apply(port, received.value)

    def _apply(self, port: int, policy: ServerPolicy) -> None:
        self.answered.add(port)
        current = self.policies.get(port)
        if policy == current:
            return
        self.policies.set(port, policy)
        log.info("port %d: policy %s (%s)", port, policy.meta, policy.protocol.value)


def _watch_port(channel: Channel) -> Any:
    return inbound_grpc.InboundServerPoliciesStub(channel).WatchPort.open()
