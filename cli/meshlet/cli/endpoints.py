"""`meshlet diagnostics endpoints`: what the destination service tells proxies about an
authority, asked the way a proxy asks (`Destination.Get` over gRPC) and read from the first
message of the stream, which by contract carries the whole current set: every endpoint with its
weight, TLS identity, protocol hint and metric labels, or `no_endpoints`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshlet.api import addr, destination_pb2
from meshlet.api import wellknown as wk
from meshlet.api.hostport import format_hostport
from meshlet.cli import tables
from meshlet.cli.grpcchannel import control_channel


@dataclass(frozen=True, slots=True)
class Endpoint:
    authority: str
    namespace: str
    service: str  # `<service>.<namespace>`, as linkerd prints it
    ip: str
    port: int
    pod: str
    weight: int
    identity: str  # "" when the destination sends no TLS identity (not meshed)
    server_name: str  # the SNI a proxy sends to it
    protocol: str  # "h2", "opaque" or ""
    transport_port: int | None  # opaque_transport.inbound_port: the peer proxy's inbound port
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Answer:
    authority: str
    endpoints: tuple[Endpoint, ...]
    exists: bool = True  # False: the destination knows no such service


def authority(name: str, namespace: str, port: int | None, cluster_domain: str) -> str:
    """`SVC` with a namespace and port → `SVC.NS.svc.DOMAIN:PORT`; a name with dots is taken as
    written, given `--port` when it has none (the destination reads no port as 80)."""
    if ":" in name.rsplit("]", 1)[-1]:
        return name
    host = name if "." in name else f"{name}.{namespace}.svc.{cluster_domain}"
    return format_hostport(host, port if port is not None else 80)


def _identity(tls: destination_pb2.TlsIdentity) -> str:
    kind = tls.WhichOneof("strategy")
    if kind == "dns_like_identity":
        return tls.dns_like_identity.name
    if kind == "uri_like_identity":
        return tls.uri_like_identity.uri
    return ""


def answer(authority: str, update: destination_pb2.Update) -> Answer:
    """The first `Update` of a `Get` stream, as rows."""
    kind = update.WhichOneof("update")
    if kind == "no_endpoints":
        return Answer(authority, (), exists=update.no_endpoints.exists)
    if kind != "add":
        raise ValueError(f"the stream began with {kind or 'an empty update'}, not the whole set")
    set_labels = dict(update.add.metric_labels)
    rows = []
    for weighted in update.add.addrs:
        ip, port = addr.tcp_from_proto(weighted.addr)
        labels = {**set_labels, **weighted.metric_labels}
        hint = weighted.protocol_hint
        transport = hint.opaque_transport.inbound_port if hint.HasField("opaque_transport") else 0
        rows.append(
            Endpoint(
                authority=authority,
                namespace=labels.get("namespace", ""),
                service=f"{labels.get('service', '')}.{labels.get('namespace', '')}",
                ip=str(ip),
                port=port,
                pod=labels.get("pod", ""),
                weight=weighted.weight,
                identity=_identity(weighted.tls_identity),
                server_name=weighted.tls_identity.server_name.name,
                protocol=hint.WhichOneof("protocol") or "",
                transport_port=transport or None,
                labels=dict(sorted(labels.items())),
            )
        )
    rows.sort(key=lambda e: (e.ip, e.port))
    return Answer(authority, tuple(rows))


# -- rendering (pure) ---------------------------------------------------------------------


def table(answers: Iterable[Answer], *, wide: bool) -> str:
    header = ["NAMESPACE", "IP", "PORT", "POD", "SERVICE", "WEIGHT", "PROTOCOL", "IDENTITY"]
    if wide:
        header += ["TRANSPORT", "LABELS"]
    rows = []
    for e in (e for a in answers for e in a.endpoints):
        cells = [e.namespace, e.ip, str(e.port), e.pod or "-", e.service, str(e.weight),
                 e.protocol or "-", e.identity or "-"]  # fmt: skip
        if wide:
            labels = ",".join(f"{k}={v}" for k, v in e.labels.items())
            cells += [str(e.transport_port or "-"), labels or "-"]
        rows.append(cells)
    left = {"NAMESPACE", "IP", "POD", "SERVICE", "PROTOCOL", "IDENTITY", "LABELS"}
    return tables.render(header, rows, left=left)


def as_json(answers: Iterable[Answer]) -> str:
    docs = [
        {"authority": e.authority, "namespace": e.namespace, "ip": e.ip, "port": e.port,
         "pod": e.pod, "service": e.service, "weight": e.weight, "identity": e.identity,
         "server_name": e.server_name, "protocol": e.protocol,
         "opaque_transport_port": e.transport_port, "labels": e.labels}
        for a in answers for e in a.endpoints
    ]  # fmt: skip
    return json.dumps(docs, indent=2) + "\n"


def missing_report(answers: Iterable[Answer]) -> str:
    lines = [
        f"No endpoints for {a.authority}: "
        + ("the service exists but has no ready endpoints." if a.exists else "no such service.")
        for a in answers
        if not a.endpoints
    ]
    return "".join(line + "\n" for line in lines)


# -- asking the destination (I/O) -----------------------------------------------------------


class DestinationError(Exception):
    """The destination could not be asked, or refused; `str()` says which and why."""


def _refusal(name: str, code: Any, details: str, timeout: float) -> DestinationError:
    if code.name == "UNAVAILABLE":
        return DestinationError(f"cannot reach the destination service: {details}")
    if code.name == "DEADLINE_EXCEEDED":
        return DestinationError(f"the destination sent nothing for {name} in {timeout:g}s")
    return DestinationError(f"the destination refused {name}: {code.name}: {details}")


def ask(
    target: str,
    authorities: Sequence[str],
    *,
    token: str,
    timeout: float,
    ca: bytes | None = None,
    server_name: str = wk.DESTINATION_SERVICE_NAME,
) -> list[Answer]:
    """One `Get` per authority on a channel to `target` (TLS verified against `ca` when given,
    else plaintext), each read for its first message and then cancelled."""
    import grpc

    from meshlet.api import destination_pb2_grpc

    channel = control_channel(target, ca, server_name)
    answers = []
    with channel:
        stub = destination_pb2_grpc.DestinationStub(channel)
        for name in authorities:
            request = destination_pb2.GetDestination(scheme="http:", path=name, context_token=token)
            call = stub.Get(request, timeout=timeout)
            try:
                first = next(call, None)
            except grpc.RpcError as exc:
                raise _refusal(name, exc.code(), exc.details() or "", timeout) from None
            finally:
                call.cancel()
            if first is None:
                raise DestinationError(f"the destination ended the stream for {name} at once")
            try:
                answers.append(answer(name, first))
            except ValueError as exc:
                raise DestinationError(f"{name}: {exc}") from None
    return answers
