"""`config.meshlet.io/*` annotations: the per-pod proxy settings, over the mesh-wide defaults.

A pod's annotation wins over its namespace's. A value that does not parse, or that the proxy's
own loader would refuse (so that the proxy would exit and the pod never start), is ignored with
a message and the default stays in force: a typo never blocks a pod. No annotation grants
privilege: the init container, which runs as root with NET_ADMIN and NET_RAW, always runs the
installation's image, whatever `config.meshlet.io/proxy-image` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.controlplane.injector import grammar
from meshlet.controlplane.injector.config import ProxyDefaults, Resources
from meshlet.proxy import config as proxy_config

MAX_SHOWN: Final = 60  # characters of a bad value quoted back in a message


@dataclass(frozen=True, slots=True)
class Setting:
    annotation: str
    field: str  # of ProxySettings
    parse: Callable[[str], Any]
    # The proxy variable the value becomes: checked with the proxy's own parser too.
    env: wellknown.ProxyEnv | None = None


# The one table of the annotations the injector reads.
SETTINGS: Final = (
    Setting(wellknown.PROXY_IMAGE_ANNOTATION, "image", grammar.image),
    Setting(
        wellknown.PROXY_LOG_LEVEL_ANNOTATION,
        "log_level",
        grammar.log_level,
        wellknown.ProxyEnv.LOG,
    ),
    Setting(
        wellknown.DEFAULT_INBOUND_POLICY_ANNOTATION,
        "default_inbound_policy",
        grammar.inbound_policy,
        wellknown.ProxyEnv.INBOUND_DEFAULT_POLICY,
    ),
    Setting(wellknown.PROXY_NATIVE_SIDECAR_ANNOTATION, "native_sidecar", grammar.flag),
    Setting(wellknown.PROXY_AWAIT_ANNOTATION, "proxy_await", grammar.flag),
    Setting(
        wellknown.OPAQUE_PORTS_ANNOTATION,
        "opaque_ports",
        grammar.ports,
        wellknown.ProxyEnv.INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION,
    ),
    Setting(wellknown.SKIP_INBOUND_PORTS_ANNOTATION, "skip_inbound_ports", grammar.ports),
    Setting(wellknown.SKIP_OUTBOUND_PORTS_ANNOTATION, "skip_outbound_ports", grammar.ports),
    Setting(
        wellknown.REQUIRE_IDENTITY_PORTS_ANNOTATION,
        "require_identity_ports",
        grammar.ports,
        wellknown.ProxyEnv.INBOUND_PORTS_REQUIRE_IDENTITY,
    ),
    Setting(
        wellknown.OUTBOUND_CONNECT_TIMEOUT_ANNOTATION,
        "outbound_connect_timeout",
        grammar.duration,
        wellknown.ProxyEnv.OUTBOUND_CONNECT_TIMEOUT,
    ),
    Setting(
        wellknown.SHUTDOWN_GRACE_PERIOD_ANNOTATION,
        "shutdown_grace_period",
        grammar.duration,
        wellknown.ProxyEnv.SHUTDOWN_GRACE_PERIOD,
    ),
    Setting(
        wellknown.IDLE_TIMEOUT_ANNOTATION,
        "stream_idle_timeout",
        grammar.duration,
        wellknown.ProxyEnv.HTTP_STREAM_IDLE_TIMEOUT,
    ),
    Setting(
        wellknown.ACCESS_LOG_ANNOTATION,
        "access_log",
        grammar.keyword,
        wellknown.ProxyEnv.ACCESS_LOG,
    ),
    Setting(
        wellknown.ESCAPED_SLASHES_ANNOTATION,
        "escaped_slashes",
        grammar.keyword,
        wellknown.ProxyEnv.INBOUND_HTTP_ESCAPED_SLASHES,
    ),
    Setting(
        wellknown.TRACE_COLLECTOR_ANNOTATION,
        "trace_collector",
        grammar.url,
        wellknown.ProxyEnv.TRACE_COLLECTOR_SVC_ADDR,
    ),
    Setting(wellknown.PROXY_CPU_REQUEST_ANNOTATION, "cpu_request", grammar.quantity),
    Setting(wellknown.PROXY_CPU_LIMIT_ANNOTATION, "cpu_limit", grammar.quantity),
    Setting(wellknown.PROXY_MEMORY_REQUEST_ANNOTATION, "memory_request", grammar.quantity),
    Setting(wellknown.PROXY_MEMORY_LIMIT_ANNOTATION, "memory_limit", grammar.quantity),
)


_RESOURCE_FIELDS: Final = ("cpu_request", "cpu_limit", "memory_request", "memory_limit")


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What one pod's proxy and init container are built from."""

    image: str  # the proxy's
    init_image: str  # the init container's: the installation's, never an annotation's
    image_pull_policy: str
    log_level: str
    default_inbound_policy: str
    native_sidecar: bool
    proxy_await: bool  # a classic sidecar's postStart waits for the proxy to be ready
    opaque_ports: str
    skip_inbound_ports: str
    skip_outbound_ports: str
    require_identity_ports: str
    outbound_connect_timeout: str
    shutdown_grace_period: str
    stream_idle_timeout: str
    access_log: str
    escaped_slashes: str
    trace_collector: str
    resources: Resources
    iptables_mode: str


@dataclass(frozen=True, slots=True)
class Resolved:
    settings: ProxySettings
    inherited: dict[str, str]  # namespace annotations in force that the pod lacks
    messages: tuple[str, ...]  # annotations ignored, and why


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def resolve(
    defaults: ProxyDefaults,
    namespace_annotations: Mapping[str, str],
    pod_annotations: Mapping[str, str],
) -> Resolved:
    """The pod's settings: its annotations, else its namespace's, else the defaults."""
    values: dict[str, Any] = {
        "image": defaults.image,
        "init_image": defaults.image,
        "image_pull_policy": defaults.image_pull_policy,
        "log_level": defaults.log_level,
        "default_inbound_policy": defaults.default_inbound_policy,
        "native_sidecar": defaults.native_sidecar,
        "proxy_await": True,
        "opaque_ports": defaults.opaque_ports,
        "skip_inbound_ports": defaults.ignore_inbound_ports,
        "skip_outbound_ports": defaults.ignore_outbound_ports,
        "require_identity_ports": defaults.require_identity_ports,
        "outbound_connect_timeout": defaults.outbound_connect_timeout,
        "shutdown_grace_period": defaults.shutdown_grace_period,
        "stream_idle_timeout": defaults.stream_idle_timeout,
        "access_log": "",
        "escaped_slashes": "",
        "trace_collector": "",
        "iptables_mode": defaults.iptables_mode,
        **dataclasses.asdict(defaults.resources),
    }
    inherited: dict[str, str] = {}
    messages: list[str] = []
    for setting in SETTINGS:
        for where, found in (("pod", pod_annotations), ("namespace", namespace_annotations)):
            raw = found.get(setting.annotation)
            if raw is None:
                continue
            try:
                value = setting.parse(raw)
                if setting.env is not None:
                    proxy_config.check(setting.env, str(value))
                values[setting.field] = value
            except ValueError as exc:
                shown = _cut(raw, MAX_SHOWN)
                reason = _cut(str(exc), 2 * MAX_SHOWN)
                messages.append(
                    f"{where} annotation {setting.annotation}={shown!r} ignored: {reason}"
                )
                continue
            if where == "namespace":
                inherited[setting.annotation] = raw
            break
    resources = Resources(**{f: values.pop(f) for f in _RESOURCE_FIELDS})
    return Resolved(ProxySettings(resources=resources, **values), inherited, tuple(messages))
