"""Shared pieces of the controllers' command line: env-backed options, addresses, exit 64."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any, Final, Protocol

import click

from meshlet.api import wellknown
from meshlet.api.durations import parse_duration
from meshlet.api.hostport import HostPort, parse_hostport
from meshlet.controlplane.supervise import Supervisor

EX_CONFIG: Final = 64  # sysexits EX_USAGE: bad configuration


def option(*decls: str, **attrs: Any) -> Callable[[Any], Any]:
    """A click option also read from `MESHLET_<FLAG>` (e.g. `--admin-addr` → MESHLET_ADMIN_ADDR)."""
    flag = next(d for d in decls if d.startswith("--"))
    envvar = wellknown.CONTROLLER_ENV_PREFIX + flag[2:].upper().replace("-", "_")
    return click.option(*decls, envvar=envvar, show_envvar=True, **attrs)


def parse_addr(value: str) -> HostPort:
    """`:8080`, `0.0.0.0:8080`, `[::]:8080` or `127.0.0.1:0` → (host, port)."""
    return parse_hostport(value, empty_host="0.0.0.0", port_zero=True)


class Addr(click.ParamType):  # type: ignore[type-arg]
    name = "[host]:port"

    def convert(self, value: Any, param: Any, ctx: Any) -> HostPort:
        if isinstance(value, tuple):
            return HostPort(*value)
        try:
            return parse_addr(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """`500ms`, `10s`, `2m`, `24h` → seconds."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


class Service(Protocol):
    supervisor: Supervisor

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def serve_until_signalled(service: Service, name: str) -> int:
    """Starts `service` (named `name` in logs), waits for SIGTERM or SIGINT, or for its
    supervisor to give up on a background task, then stops it; the exit code (1: gave up)."""
    await service.start()
    supervisor = service.supervisor
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, supervisor.stop)
    await supervisor.stopping.wait()
    if supervisor.failure is None:
        logging.getLogger(f"meshlet.controlplane.{name}").info("%s shutting down", name)
    await service.stop()
    return 0 if supervisor.failure is None else 1


def log_level_option() -> Callable[[Any], Any]:
    return option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default="info",
        show_default=True,
    )


def reload_interval_option(default: float, reloads: str) -> Callable[[Any], Any]:
    """`--reload-interval`: seconds between checks for new files (`reloads`: what they hold)."""
    return option(
        "--reload-interval",
        type=click.FloatRange(min=0.1),
        default=default,
        show_default=True,
        help=f"Seconds between checks for {reloads}.",
    )


def watching_options(reads: str) -> Callable[[Any], Any]:
    """The options of a controller that watches the cluster (destination, policy): where from
    (`reads`: what a manifests folder holds), TLS for its gRPC, its stream bounds and log level.
    They arrive as `kubeconfig, in_cluster, manifests, tls_cert, tls_key, max_streams,
    max_streams_per_peer, log_level`."""
    from pathlib import Path

    decorators = [
        option(
            "--kubeconfig",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Watch the Kubernetes API reached with this kubeconfig.",
        ),
        option(
            "--in-cluster",
            is_flag=True,
            help="Watch the Kubernetes API as the pod's service account.",
        ),
        option(
            "--manifests",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help=f"Read {reads} from YAML files here.",
        ),
        option(
            "--tls-cert",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Serve TLS with this PEM certificate chain (the local mesh); default: plaintext.",
        ),
        option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path)),
        option("--max-streams", type=click.IntRange(min=1), default=20_000, show_default=True),
        option(
            "--max-streams-per-peer", type=click.IntRange(min=1), default=4_096, show_default=True
        ),
        log_level_option(),
    ]

    def apply(command: Any) -> Any:
        for decorate in reversed(decorators):
            command = decorate(command)
        return command

    return apply


def watching_problems(
    kubeconfig: object, in_cluster: bool, manifests: object, tls_cert: object, tls_key: object
) -> list[str]:
    """What is wrong with a watching controller's source and TLS options."""
    problems = []
    if sum((kubeconfig is not None, in_cluster, manifests is not None)) != 1:
        problems.append("give exactly one of --kubeconfig, --in-cluster, --manifests")
    if (tls_cert is None) != (tls_key is None):
        problems.append("--tls-cert and --tls-key go together")
    return problems


def listen_options(port: int, admin_port: int, serves: str) -> Callable[[Any], Any]:
    """`--addr` (`serves`: what listens there) and `--admin-addr` (/metrics, /ready, /live),
    on every interface at their well-known ports by default."""
    addr = option("--addr", type=Addr(), default=f":{port}", show_default=True,
                  help=f"{serves} listen address.")  # fmt: skip
    admin = option(
        "--admin-addr",
        type=Addr(),
        default=f":{admin_port}",
        show_default=True,
        help="Admin (/metrics, /ready, /live) listen address.",
    )
    return lambda command: addr(admin(command))


def cluster_source(
    manifests: Any, kubeconfig: Any, in_cluster: bool, kinds: tuple[Any, ...]
) -> Any:
    """What a controller watches `kinds` from: the local mesh's manifests folder (read every
    0.2 s), else the Kubernetes API (a kubeconfig, or the pod's service account)."""
    if manifests is not None:
        from meshlet.controlplane.k8s.manifests import ManifestsSource

        return ManifestsSource(manifests, kinds=kinds, poll_interval=0.2)
    from meshlet.controlplane.k8s.client import api_client
    from meshlet.controlplane.k8s.informer import KubernetesSource

    return KubernetesSource(api_client(kubeconfig, in_cluster), kinds=kinds)
