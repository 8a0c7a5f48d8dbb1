"""`meshlet diagnostics policy`: what the policy controller sends a proxy, asked the way a proxy
asks and printed as the message itself, in protobuf's JSON mapping or as YAML: the inbound policy
of a pod's port (`InboundServerPolicies.GetPort` with the pod's workload), or the outbound policy
of a Service's port (`OutboundPolicies.Get` with the Service's name as authority). While that
Service's ServiceProfile has routes or dstOverrides, proxies use it instead of what the
controller sends; a note on stderr says so, so that routes that change nothing are no mystery."""

from __future__ import annotations

import json
from typing import Any, Final

import yaml
from google.protobuf.message import Message

from meshlet.api import inbound_pb2, outbound_pb2
from meshlet.api import wellknown as wk
from meshlet.cli.grpcchannel import control_channel

OUTPUTS: Final = ("json", "yaml")
CLI_POD: Final = "meshlet-cli"  # the workload an outbound question is asked for


class PolicyError(Exception):
    """The controller could not be asked, or refused; `str()` says which and why."""


def workload(namespace: str, pod: str) -> str:
    """The `PortSpec.workload` a proxy sends: `{"ns":"NS","pod":"NAME"}`."""
    return json.dumps({"ns": namespace, "pod": pod}, separators=(",", ":"))


def render(server: Message, output: str) -> str:
    """The message as protobuf's canonical JSON (field names in lowerCamelCase) or as the same
    document in YAML. Fields at their zero value are printed too: an empty list of
    authorizations (nothing is allowed) or a /0 prefix must show, not vanish."""
    from google.protobuf import json_format

    doc = json_format.MessageToDict(server, always_print_fields_with_no_presence=True)
    if output == "yaml":
        return yaml.safe_dump(doc, sort_keys=False)
    return json.dumps(doc, indent=2) + "\n"


def _refusal(what: str, code: Any, details: str, timeout: float) -> PolicyError:
    name = code.name
    if name == "UNAVAILABLE":
        return PolicyError(f"cannot reach the policy controller: {details}")
    if name == "DEADLINE_EXCEEDED":
        return PolicyError(f"the policy controller sent nothing for {what} in {timeout:g}s")
    if name == "NOT_FOUND":
        return PolicyError(f"the policy controller does not know {what}: {details}")
    return PolicyError(f"the policy controller refused {what}: {name}: {details}")


def ask(
    target: str,
    namespace: str,
    pod: str,
    port: int,
    *,
    timeout: float,
    ca: bytes | None = None,
    server_name: str = wk.POLICY_SERVICE_NAME,
) -> inbound_pb2.Server:
    """One `GetPort` on a channel to `target` (TLS verified against `ca` for `server_name`
    when given, else plaintext)."""
    import grpc

    from meshlet.api import inbound_pb2_grpc

    channel = control_channel(target, ca, server_name)
    what = f"pod {namespace}/{pod} port {port}"
    request = inbound_pb2.PortSpec(workload=workload(namespace, pod), port=port)
    with channel:
        stub = inbound_pb2_grpc.InboundServerPoliciesStub(channel)
        try:
            server: inbound_pb2.Server = stub.GetPort(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _refusal(what, exc.code(), exc.details() or "", timeout) from None
    return server


def service_authority(namespace: str, service: str, port: int) -> str:
    """The authority a meshed client names a Service's port by: `NAME.NS.svc.DOMAIN:PORT`."""
    return f"{service}.{namespace}.svc.{wk.CLUSTER_DOMAIN}:{port}"


def ask_outbound(
    target: str,
    namespace: str,
    service: str,
    port: int,
    *,
    timeout: float,
    ca: bytes | None = None,
    server_name: str = wk.POLICY_SERVICE_NAME,
) -> outbound_pb2.OutboundPolicy:
    """One `OutboundPolicies.Get` for the Service's port, as a client in its namespace asks."""
    import grpc

    from meshlet.api import outbound_pb2_grpc

    channel = control_channel(target, ca, server_name)
    authority = service_authority(namespace, service, port)
    request = outbound_pb2.TrafficSpec(source_workload=workload(namespace, CLI_POD),
                                       authority=authority)  # fmt: skip
    with channel:
        stub = outbound_pb2_grpc.OutboundPoliciesStub(channel)
        try:
            policy: outbound_pb2.OutboundPolicy = stub.Get(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _refusal(f"service {authority}", exc.code(), exc.details() or "",
                           timeout) from None  # fmt: skip
    return policy


def profile_name(namespace: str, service: str) -> str:
    """The ServiceProfile that takes precedence over a Service's routes: `NAME.NS.svc.DOMAIN`."""
    return f"{service}.{namespace}.svc.{wk.CLUSTER_DOMAIN}"


def shadow_note(namespace: str, service: str) -> str:
    name = profile_name(namespace, service)
    return (
        f"note: ServiceProfile {namespace}/{name} has routes or dstOverrides: proxies use it for"
        f" service {namespace}/{service} and ignore the routes and the retry and timeout"
        " annotations below (kept for backwards compatibility); delete the ServiceProfile to use"
        " them"
    )


def profile_exists(api: Any, namespace: str, service: str) -> bool:
    """Whether the Service's ServiceProfile exists and takes precedence (routes or
    dstOverrides); False too when it cannot be read (the note is a hint, never a reason to fail
    the command)."""
    from kubernetes import client
    from urllib3.exceptions import HTTPError

    from meshlet.cli.checks import overrides_policy

    try:
        response: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
            "meshlet.io", "v1alpha1", namespace, "serviceprofiles",
            profile_name(namespace, service), _preload_content=False, _request_timeout=10,
        )  # fmt: skip
        found = json.loads(response.data)
    except (client.ApiException, HTTPError, OSError, ValueError):
        return False
    return isinstance(found, dict) and overrides_policy(found)
