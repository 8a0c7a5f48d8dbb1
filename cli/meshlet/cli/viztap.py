"""`meshlet viz tap`: live requests of a resource's proxies, read from the tap controller."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from meshlet.api import wellknown as wk
from meshlet.api.hostport import HostPort
from meshlet.cli import localmesh, options
from meshlet.cli.localmesh import NAMESPACE_HELP

KUBECONFIG_HELP = "Default: $KUBECONFIG or ~/.kube/config."


def source_options(command: Any) -> Any:
    """The options that say which requests to tap and where the tap controller is."""
    for option in reversed([
        click.option("-n", "--namespace", help="RESOURCE's namespace. " + NAMESPACE_HELP),
        click.option("--to", "to", metavar="RES", help="Only outbound requests to RES."),
        click.option("--to-namespace", help="RES's namespace. Default: RESOURCE's."),
        click.option("--method", help="Only requests with this HTTP method."),
        click.option("--path", help="Only requests whose path starts with this."),
        click.option("--authority", help="Only requests to this authority."),
        click.option("--max-rps", type=click.FloatRange(min=0.1, max=100_000), default=100.0,
                     show_default=True, help="Requests per second to show at most."),
        click.option("--tap-addr", metavar="HOST:PORT",
                     help="Ask this tap controller directly instead of a port-forward."),
        click.option("--tap-pod", help="Which tap controller pod to port-forward to."),
        options.control_plane_namespace(),
        options.cluster,
    ]):  # fmt: skip
        command = option(command)
    return command


@contextlib.contextmanager
def tap_events(
    resource: str,
    namespace: str | None,
    to: str | None,
    to_namespace: str | None,
    method: str | None,
    path: str | None,
    authority: str | None,
    max_rps: float,
    tap_addr: str | None,
    tap_pod: str | None,
    control_plane_namespace: str,
    kubeconfig: Path | None,
    context: str | None,
) -> Iterator[Iterator[dict[str, Any]]]:
    """The tap controller's events for RESOURCE, through a port-forward to its pod, directly
    (--tap-addr), or from a running local mesh's when no kubeconfig is configured. A refusal
    or a broken stream is a ClusterError naming the controller."""
    from meshlet.api.hostport import parse_hostport
    from meshlet.cli import tap as taps
    from meshlet.cli.cluster import ClusterError, api_client

    local = None
    if tap_addr is None and not localmesh.cluster_named(kubeconfig, context):
        local = localmesh.kept()
        if local is not None and "tap" not in local.urls:
            local = None
    if local is not None:  # a local mesh kept running (`meshlet demo --keep`)
        tap_addr = local.urls["tap"].removeprefix("http://")
    namespace = localmesh.namespace(namespace, local, kubeconfig, context)
    path_query = taps.query({
        "resource": resource, "namespace": namespace, "to": to, "to_namespace": to_namespace,
        "method": method, "path": path, "authority": authority, "max_rps": f"{max_rps:g}",
    })  # fmt: skip
    forward: contextlib.AbstractContextManager[HostPort | None]
    if tap_addr is not None:
        try:
            direct = parse_hostport(tap_addr)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--tap-addr") from None
        forward, where = contextlib.nullcontext(), tap_addr
    else:
        from meshlet.cli.diagnostics import _component_pod
        from meshlet.cli.portforward import PortForward

        api = api_client(kubeconfig, context)
        pod = _component_pod(api, control_plane_namespace, "tap", tap_pod)
        forward = PortForward(api, control_plane_namespace, pod, wk.TAP_PORT)
        where = f"{control_plane_namespace}/{pod}:{wk.TAP_PORT} (port-forward)"

    def events(host: str, port: int) -> Iterator[dict[str, Any]]:
        try:
            yield from taps.stream(host, port, path_query)
        except taps.TapError as exc:
            raise ClusterError(f"{exc} [{where}]") from None

    with forward as forwarded:
        host, port = forwarded if forwarded is not None else direct
        yield events(host, port)


@click.command("tap")
@click.argument("resource", metavar="RESOURCE")
@source_options
@click.option("-o", "--output", type=click.Choice(["wide", "json"]), default=None,
              help="wide: with source and destination; json: an object a line.")  # fmt: skip
def tap(resource: str, output: str | None, **source: Any) -> None:
    """Print the live requests of RESOURCE's proxies (deploy/NAME, pod/NAME, ns/NAME).

    Each request shows as `req`, `rsp` and `end` lines (id, proxy direction, source,
    destination, TLS, then method/authority/path, status and latency, duration and bytes), as
    `linkerd viz tap` prints them; `-o json` prints the tap controller's objects as they come.
    The tap controller is reached through a port-forward to its pod (as `kubectl
    port-forward`), with --tap-addr directly, or, when no kubeconfig is configured (none given,
    no $KUBECONFIG, no ~/.kube/config) and a local mesh is running (`meshlet demo --keep`),
    that mesh's (namespace demo). Ctrl-C ends the tap.

    \b
    meshlet viz tap deploy/web -n emojivoto
    meshlet viz tap ns/emojivoto --path /api --method GET -o wide
    meshlet viz tap deploy/web -n emojivoto --tap-addr 127.0.0.1:8088 -o json
    """
    from meshlet.cli import tap as taps

    with tap_events(resource, **source) as events:
        try:
            for event in events:
                if output == "json":
                    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
                else:
                    sys.stdout.write(taps.render(event, wide=output == "wide") + "\n")
                sys.stdout.flush()
        except KeyboardInterrupt:
            return
