"""An application's own topology for a local mesh: its services as command lines, each with
replicas, a port and a protocol, in one Kubernetes namespace, plus a folder of its own policy
resources. Pure: `problems` names everything wrong with a spec at once."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown

PROTOCOLS: Final = ("http", "grpc", "opaque")  # http and grpc: detected; opaque: plain TCP
CLIENT: Final = "client"  # the mesh's own client pod: what `Mesh.get` calls from
MAX_PODS: Final = 200  # addresses in a mesh's /20 for pods: 10.77.(16N+1).10-209
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class Service:
    """A Deployment and its Service: `replicas` pods named `<name>-1…`, each running `command`
    in its own network namespace beside its proxy. `{port}`, `{pod}`, `{ip}` and `{namespace}`
    in the command's arguments are replaced; the same values are in the environment as PORT,
    POD_NAME, POD_IP and POD_NAMESPACE. The app calls other services by name (`http://api:8080`,
    `api.<namespace>`, or the full `api.<namespace>.svc.cluster.local`): the pod's rules send
    the connection to its proxy."""

    name: str
    command: tuple[str, ...]
    port: int
    replicas: int = 1
    protocol: str = "http"
    env: Mapping[str, str] = field(default_factory=dict)
    # meshlet's annotations (Linkerd's, with meshlet's prefix), on the Service and its pods as
    # a user sets them: timeouts, retries, failure accrual, opaque ports, …
    annotations: Mapping[str, str] = field(default_factory=dict)

    def pods(self) -> list[str]:
        return [f"{self.name}-{n}" for n in range(1, self.replicas + 1)]


@dataclass(frozen=True, slots=True)
class Spec:
    services: tuple[Service, ...]
    namespace: str = "default"
    policy: Path | None = None  # a folder of YAML: ServiceProfiles, HTTPRoutes, policy resources

    def service(self, name: str) -> Service:
        for svc in self.services:
            if svc.name == name:
                return svc
        raise KeyError(f"no service {name!r} (the mesh has: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [svc.name for svc in self.services]


def service(
    name: str,
    command: str | Sequence[str],
    *,
    port: int,
    replicas: int = 1,
    protocol: str = "http",
    env: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Service:
    """A Service; `command` as a shell would split it, or as a list of arguments."""
    import shlex

    argv = tuple(shlex.split(command) if isinstance(command, str) else command)
    return Service(name, argv, port, replicas, protocol, dict(env or {}), dict(annotations or {}))


def asgi(
    name: str,
    app: str,
    *,
    port: int,
    replicas: int = 1,
    env: Mapping[str, str] | None = None,
    path: Path | str | None = None,
    interface: str = "asgi3",
) -> Service:
    """A Service whose pods serve the ASGI application `app` ("package.module:attribute"),
    importable from `path` when given, with uvicorn (which the test environment provides):
    HTTP/1.1, and WebSocket upgrades."""
    env = dict(env or {})
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "uvicorn", app, "--interface", interface,
               "--host", "{ip}", "--port", "{port}", "--no-access-log"]  # fmt: skip
    return Service(name, tuple(command), port, replicas, "http", env)


def wsgi(name: str, app: str, **options: Any) -> Service:
    """A Service whose pods serve the WSGI application `app` (Flask, Django's
    `wsgi:application`, …): `asgi`'s options, through uvicorn's WSGI interface."""
    return asgi(name, app, interface="wsgi", **options)


def problems(spec: Spec) -> list[str]:
    """Everything wrong with `spec`, each naming where; [] when it can be built."""
    found = []
    if _LABEL.fullmatch(spec.namespace) is None or len(spec.namespace) > 63:
        found.append(f"namespace {spec.namespace!r}: not a DNS label")
    if not spec.services:
        found.append("no services")
    seen: set[str] = set()
    for svc in spec.services:
        where = f"service {svc.name!r}"
        if _LABEL.fullmatch(svc.name) is None or len(svc.name) > 40:
            found.append(f"{where}: the name is not a DNS label of up to 40 characters")
        if svc.name in seen:
            found.append(f"{where}: declared twice")
        if svc.name == CLIENT:
            found.append(f"{where}: the name is the mesh's own client pod's")
        seen.add(svc.name)
        if not svc.command:
            found.append(f"{where}: no command")
        if not 1 <= svc.port <= 65535:
            found.append(f"{where}: port {svc.port} is not 1-65535")
        elif svc.port in _PROXY_PORTS:
            found.append(f"{where}: port {svc.port} is the proxy's own")
        if not 1 <= svc.replicas <= 50:
            found.append(f"{where}: replicas {svc.replicas} is not 1-50")
        for key in svc.annotations:
            domain, slash, _ = key.partition("/")
            if not slash or not (domain == "meshlet.io" or domain.endswith(".meshlet.io")):
                found.append(f"{where}: annotation {key!r} is not one of meshlet's"
                             " (config.meshlet.io/…, retry.meshlet.io/…, …)")  # fmt: skip
        if svc.protocol not in PROTOCOLS:
            found.append(f"{where}: protocol {svc.protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if sum(max(svc.replicas, 0) for svc in spec.services) + 1 > MAX_PODS:
        found.append(f"more than {MAX_PODS} pods")
    if spec.policy is not None and not spec.policy.is_dir():
        found.append(f"policy folder {spec.policy}: not a folder")
    return found


_PROXY_PORTS: Final = frozenset(
    (wellknown.PROXY_OUTBOUND_PORT, wellknown.PROXY_INBOUND_PORT, wellknown.PROXY_CONTROL_PORT,
     wellknown.PROXY_ADMIN_PORT)
)  # fmt: skip
