"""`meshlet diagnostics`: a proxy's raw metrics (`proxy-metrics`), the destination service's
answer for an authority (`endpoints`) and the policy controller's for a pod's port (`policy`),
as `linkerd diagnostics` has them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from meshlet.api import wellknown as wk
from meshlet.api.hostport import HostPort
from meshlet.cli import options

KUBECONFIG_HELP = "Default: $KUBECONFIG or ~/.kube/config."


@click.group()
def diagnostics() -> None:
    """Look inside the mesh: proxies' metrics, the destination's endpoints, inbound policy."""


def _target_pods(api: Any, target: str, namespace: str) -> list[Any]:
    """The pods a `POD`, `po/POD` or `deploy/NAME` argument names."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import NotFound, read_json
    from meshlet.cli.workloads import Kind, deployments, parse_target, pod_of

    try:
        wanted = parse_target(target)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="RESOURCE") from None
    core, (name,) = k8s.CoreV1Api(api), wanted.names
    if wanted.kind is Kind.POD:
        return [pod_of(read_json(f"pod {namespace}/{name}", core.read_namespaced_pod, name,
                                 namespace))]  # fmt: skip
    deploy = read_json(
        f"deployment {namespace}/{name}",
        k8s.AppsV1Api(api).read_namespaced_deployment, name, namespace,
    )  # fmt: skip
    pods = read_json("pods", core.list_namespaced_pod, namespace)
    (workload,) = deployments([deploy], [pod_of(p) for p in pods.get("items") or []])
    if not workload.pods:
        raise NotFound(f"deployment {namespace}/{name} has no pods")
    return list(workload.pods)


@diagnostics.command("proxy-metrics")
@click.argument("resource", metavar="POD | po/POD | deploy/NAME")
@click.option("-n", "--namespace", help="Default: the kubeconfig context's, else default.")
@options.cluster
def proxy_metrics(
    resource: str, namespace: str | None, kubeconfig: Path | None, context: str | None
) -> None:
    """Print the /metrics of a pod's proxy, or of every pod of a Deployment.

    Read through the API server's pod proxy on the pod's meshlet-admin port (4191), each
    under a `# POD name (i of n)` header. A pod whose proxy cannot be read gets an `# ERROR:`
    line instead; the exit code is then 1, after every pod has been printed.

    \b
    meshlet diagnostics proxy-metrics -n emojivoto deploy/web
    meshlet diagnostics proxy-metrics -n emojivoto web-5d4f8c9b7-x2x7q
    """
    from meshlet.cli.cluster import api_client, default_namespace
    from meshlet.cli.scrape import Failure, scrape_all

    api = api_client(kubeconfig, context)
    pods = _target_pods(api, resource, namespace or default_namespace(kubeconfig, context))
    results = scrape_all(api, [p for p in pods if p.meshed])
    by_pod = {r.pod.key: r for r in results}
    failed = False
    for i, pod in enumerate(pods, 1):
        sys.stdout.write(f"#\n# POD {pod.name} ({i} of {len(pods)})\n#\n")
        result = by_pod.get(pod.key)
        if result is None:
            failed = True
            sys.stdout.write(f"# ERROR: not meshed (no {wk.CONTROL_PLANE_NS_LABEL} label)\n")
        elif isinstance(result, Failure):
            failed = True
            sys.stdout.write(f"# ERROR: {result.reason}\n")
        else:
            sys.stdout.write(result.text if result.text.endswith("\n") else result.text + "\n")
    if failed:
        sys.exit(1)


@diagnostics.command("endpoints")
@click.argument("authorities", nargs=-1, required=True, metavar="AUTHORITY...")
@click.option("-n", "--namespace", help="For a bare SVC. Default: the kubeconfig context's.")
@click.option("--port", type=click.IntRange(1, 65535), help="For an authority without one [80].")
@click.option(
    "-o", "--output", type=click.Choice(["table", "wide", "json"]), default="table",
    show_default=True, help="wide adds the opaque transport port and labels.",
)  # fmt: skip
@click.option(
    "--destination-addr", metavar="HOST:PORT",
    help="Ask this destination directly instead of a port-forward to its pod.",
)  # fmt: skip
@click.option(
    "--destination-ca", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --destination-addr: trust anchors to verify its TLS with (else plaintext).",
)  # fmt: skip
@click.option(
    "--destination-name", default=wk.DESTINATION_SERVICE_NAME, show_default=True,
    help="With --destination-ca: the identity its certificate must carry.",
)  # fmt: skip
@click.option("--destination-pod", help="Which destination pod to port-forward to.")
@options.control_plane_namespace()
@click.option("--cluster-domain", default=wk.CLUSTER_DOMAIN, show_default=True,
              help="The suffix of the names asked for.")  # fmt: skip
@click.option("--token", default="", help="The context token to send, as proxies do (JSON).")
@click.option("--timeout", default="5s", show_default=True, help="For each answer.")
@options.cluster
def endpoints(
    authorities: tuple[str, ...],
    namespace: str | None,
    port: int | None,
    output: str,
    destination_addr: str | None,
    destination_ca: Path | None,
    destination_name: str,
    destination_pod: str | None,
    control_plane_namespace: str,
    cluster_domain: str,
    token: str,
    timeout: str,
    kubeconfig: Path | None,
    context: str | None,
) -> None:
    """Show what the destination service streams to proxies for each authority.

    AUTHORITY is SVC.NS.svc.cluster.local:PORT, as proxies ask for it, or a bare SVC with -n
    and --port. The question is a `Destination.Get` over gRPC, as a proxy makes it, through a
    port-forward to a running destination pod of the control plane (as `kubectl
    port-forward` does, through the API server); with --destination-addr, to that address
    directly (the local mesh of `meshlet demo --keep`: 10.77.0.2:8086, TLS from
    /run/meshlet-demo/ca/trust-anchors.pem). The first message of the stream is the whole
    current set; each endpoint is shown with its weight, protocol hint and TLS identity (and,
    wide or JSON, its opaque transport port and metric labels). An authority without
    endpoints is named on standard error (exit 0); an unreachable or refusing destination
    exits 1.

    \b
    meshlet diagnostics endpoints web.emojivoto.svc.cluster.local:80
    meshlet diagnostics endpoints web -n emojivoto --port 80 -o json
    meshlet diagnostics endpoints api.demo.svc.cluster.local:9090 \\
        --destination-addr 10.77.0.2:8086 --destination-ca /run/meshlet-demo/ca/trust-anchors.pem
    """
    import contextlib

    from meshlet.api.durations import parse_duration
    from meshlet.cli import endpoints as ep
    from meshlet.cli.cluster import ClusterError, api_client, default_namespace

    try:
        seconds = parse_duration(timeout)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--timeout") from None
    if destination_ca is not None and destination_addr is None:
        raise click.UsageError("--destination-ca goes with --destination-addr")
    if any(not a.strip() for a in authorities):
        raise click.BadParameter("an authority is empty", param_hint="AUTHORITIES")
    bare = any("." not in a and ":" not in a for a in authorities)
    if bare and namespace is None:
        namespace = default_namespace(kubeconfig, context)
    names = [ep.authority(a, namespace or "default", port, cluster_domain) for a in authorities]
    forward: contextlib.AbstractContextManager[HostPort | None]
    if destination_addr is not None:
        forward, where = contextlib.nullcontext(), destination_addr
    else:
        from meshlet.cli.portforward import PortForward

        api = api_client(kubeconfig, context)
        pod = _destination_pod(api, control_plane_namespace, destination_pod)
        forward = PortForward(api, control_plane_namespace, pod, wk.DESTINATION_PORT)
        where = f"{control_plane_namespace}/{pod}:{wk.DESTINATION_PORT} (port-forward)"
    ca = destination_ca.read_bytes() if destination_ca is not None else None
    with forward as local:
        target = str(local) if local is not None else str(destination_addr)
        try:
            answers = ep.ask(target, names, token=token, timeout=seconds, ca=ca,
                             server_name=destination_name)  # fmt: skip
        except ep.DestinationError as exc:
            said = getattr(forward, "errors", [])
            more = f" ({'; '.join(dict.fromkeys(said))})" if said else ""
            if destination_addr is not None and ca is None and str(exc).startswith("cannot"):
                more += (
                    "; if it serves TLS (the local mesh's destination does), give --destination-ca"
                )
            raise ClusterError(f"{exc} [{where}]{more}") from None
    if output == "json":
        sys.stdout.write(ep.as_json(answers))
    elif any(a.endpoints for a in answers):
        sys.stdout.write(ep.table(answers, wide=output == "wide"))
    sys.stderr.write(ep.missing_report(answers))


def _destination_pod(api: Any, namespace: str, wanted: str | None) -> str:
    return _component_pod(api, namespace, "destination", wanted)


def _component_pod(api: Any, namespace: str, component: str, wanted: str | None) -> str:
    """A running, ready pod of a control-plane component (the first by name)."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import NotFound, read_json

    selector = f"{wk.CONTROL_PLANE_COMPONENT_LABEL}={component}"
    listed = read_json(f"{component} pods", k8s.CoreV1Api(api).list_namespaced_pod, namespace,
                       label_selector=selector)  # fmt: skip
    ready = sorted(
        str(p["metadata"]["name"])
        for p in listed.get("items") or []
        if (p.get("status") or {}).get("phase") == "Running"
        and any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or [])
    )  # fmt: skip
    if wanted is not None:
        if wanted not in ready:
            raise NotFound(f"no running, ready {component} pod {namespace}/{wanted} ({selector})")
        return wanted
    if not ready:
        raise NotFound(
            f"no running, ready {component} pod in namespace {namespace!r} ({selector});"
            " is meshlet installed? meshlet check tells"
        )
    return ready[0]


@diagnostics.command("policy")
@click.argument("pod", metavar="POD|svc/NAME", required=False)
@click.argument("port", type=click.IntRange(1, 65535), metavar="PORT", required=False)
@click.option("--outbound", metavar="SVC:PORT",
              help="The outbound policy of this Service's port (as `svc/SVC PORT`).")  # fmt: skip
@click.option("-n", "--namespace", help="The pod's. Default: the kubeconfig context's.")
@click.option("-o", "--output", type=click.Choice(["json", "yaml"]), default="json",
              show_default=True, help="The policy as JSON or YAML.")  # fmt: skip
@click.option(
    "--policy-addr", metavar="HOST:PORT",
    help="Ask this policy controller directly instead of a port-forward to its pod; the pod"
    " is then not looked up.",
)  # fmt: skip
@click.option(
    "--policy-ca", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --policy-addr: trust anchors to verify its TLS with (else plaintext).",
)  # fmt: skip
@click.option(
    "--policy-name", default=wk.POLICY_SERVICE_NAME, show_default=True,
    help="With --policy-ca: the identity its certificate must carry.",
)  # fmt: skip
@click.option("--policy-pod", help="Which policy controller pod to port-forward to.")
@options.control_plane_namespace()
@click.option("--timeout", default="5s", show_default=True, help="For the answer.")
@options.cluster
def policy(
    pod: str | None,
    port: int | None,
    outbound: str | None,
    namespace: str | None,
    output: str,
    policy_addr: str | None,
    policy_ca: Path | None,
    policy_name: str,
    policy_pod: str | None,
    control_plane_namespace: str,
    timeout: str,
    kubeconfig: Path | None,
    context: str | None,
) -> None:
    """Show the inbound policy the policy controller sends POD's proxy for PORT, or the
    outbound policy it sends clients of a Service's port (`svc/NAME PORT`, or --outbound
    NAME:PORT; asked by the Service's name as authority, `OutboundPolicies.Get`).

    The question is `InboundServerPolicies.GetPort` over gRPC with the pod's workload
    ({"ns":NS,"pod":POD}), as the pod's proxy asks it, through a port-forward to a running
    policy controller pod of the control plane (as `kubectl port-forward` does, through the
    API server), after checking that the pod exists; with --policy-addr, to that address
    directly, without the Kubernetes API. The answer, a `Server` message (protocol,
    authorizations, routes, labels), is printed in protobuf's JSON mapping or as YAML. A
    pod the controller does not know, a refused question or an unreachable controller is one
    line on standard error and exit 1.

    \b
    meshlet diagnostics policy -n emojivoto web-5d4f8c9b7-x2x7q 8080
    meshlet diagnostics policy -n emojivoto web-5d4f8c9b7-x2x7q 8080 -o yaml
    meshlet diagnostics policy -n demo api-1 9090 --policy-addr HOST:8090 --policy-ca anchors.pem
    meshlet diagnostics policy -n emojivoto svc/web-svc 80
    meshlet diagnostics policy -n emojivoto --outbound web-svc:80 -o yaml
    """
    import contextlib

    from meshlet.api.durations import parse_duration
    from meshlet.cli import policy as pol
    from meshlet.cli.cluster import ClusterError, api_client, default_namespace

    try:
        seconds = parse_duration(timeout)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--timeout") from None
    if policy_ca is not None and policy_addr is None:
        raise click.UsageError("--policy-ca goes with --policy-addr")
    service, pod, port = _policy_target(pod, port, outbound)
    ns = namespace or default_namespace(kubeconfig, context)
    forward: contextlib.AbstractContextManager[HostPort | None]
    shadowed = False
    if policy_addr is not None:
        forward, where = contextlib.nullcontext(), policy_addr
    else:
        from kubernetes import client as k8s

        from meshlet.cli.cluster import read_json
        from meshlet.cli.portforward import PortForward

        api = api_client(kubeconfig, context)
        if service is not None:
            read_json(f"service {ns}/{service}", k8s.CoreV1Api(api).read_namespaced_service,
                      service, ns)  # fmt: skip
            shadowed = pol.profile_exists(api, ns, service)
        else:
            read_json(f"pod {ns}/{pod}", k8s.CoreV1Api(api).read_namespaced_pod, pod, ns)
        controller = _component_pod(api, control_plane_namespace, "policy", policy_pod)
        forward = PortForward(api, control_plane_namespace, controller, wk.POLICY_PORT)
        where = f"{control_plane_namespace}/{controller}:{wk.POLICY_PORT} (port-forward)"
    ca = policy_ca.read_bytes() if policy_ca is not None else None
    with forward as local:
        target = str(local) if local is not None else str(policy_addr)
        try:
            answer: Any
            if service is not None:
                answer = pol.ask_outbound(target, ns, service, port, timeout=seconds, ca=ca,
                                          server_name=policy_name)  # fmt: skip
            else:
                answer = pol.ask(target, ns, pod, port, timeout=seconds, ca=ca,
                                 server_name=policy_name)  # fmt: skip
        except pol.PolicyError as exc:
            said = getattr(forward, "errors", [])
            more = f" ({'; '.join(dict.fromkeys(said))})" if said else ""
            if policy_addr is not None and ca is None and str(exc).startswith("cannot"):
                more += "; if it serves TLS, give --policy-ca"
            raise ClusterError(f"{exc} [{where}]{more}") from None
    sys.stdout.write(pol.render(answer, output))
    if shadowed and service is not None:
        click.echo(pol.shadow_note(ns, service), err=True)


def _policy_target(
    pod: str | None, port: int | None, outbound: str | None
) -> tuple[str | None, str, int]:
    """(service or None, pod, port) from `POD PORT`, `svc/NAME PORT` or `--outbound NAME:PORT`."""
    if outbound is not None:
        if pod is not None or port is not None:
            raise click.UsageError("give either --outbound SVC:PORT or POD PORT, not both")
        name, _, text = outbound.rpartition(":")
        if not name or not text.isdigit() or not 1 <= int(text) <= 65535:
            raise click.BadParameter(f"{outbound!r} is not SVC:PORT (a port within 1..65535)",
                                     param_hint="--outbound")  # fmt: skip
        return name, "", int(text)
    if pod is None or port is None:
        raise click.UsageError("give POD PORT, svc/NAME PORT or --outbound SVC:PORT")
    kind, slash, name = pod.partition("/")
    if slash and kind in ("svc", "service", "services"):
        if not name.strip():
            raise click.BadParameter("the service name is empty", param_hint="POD|svc/NAME")
        return name, "", port
    if slash and kind in ("po", "pod", "pods"):
        pod = name
    elif slash:
        raise click.BadParameter(f"{kind!r} is not po or svc", param_hint="POD|svc/NAME")
    if not pod.strip():
        raise click.BadParameter("the pod name is empty", param_hint="POD|svc/NAME")
    return None, pod, port
