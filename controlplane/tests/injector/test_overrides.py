"""`config.meshlet.io/*` annotations: pod over namespace over defaults; junk ignored, named."""

from __future__ import annotations

import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector.config import ProxyDefaults
from meshlet.controlplane.injector.overrides import SETTINGS, resolve

DEFAULTS = ProxyDefaults()


def test_defaults_without_annotations() -> None:
    resolved = resolve(DEFAULTS, {}, {})
    assert resolved.settings.opaque_ports == "25,587,3306,4444,5432,6379,9300,11211"
    assert resolved.settings.native_sidecar is True
    assert resolved.messages == () and resolved.inherited == {}


def test_pod_wins_over_namespace() -> None:
    resolved = resolve(
        DEFAULTS,
        {wk.PROXY_LOG_LEVEL_ANNOTATION: "debug", wk.OPAQUE_PORTS_ANNOTATION: "3306"},
        {wk.PROXY_LOG_LEVEL_ANNOTATION: "error"},
    )
    assert resolved.settings.log_level == "error"
    assert resolved.settings.opaque_ports == "3306"
    assert resolved.inherited == {wk.OPAQUE_PORTS_ANNOTATION: "3306"}


def test_junk_port_annotations_are_ignored_with_a_message() -> None:
    resolved = resolve(
        DEFAULTS,
        {},
        {
            wk.SKIP_INBOUND_PORTS_ANNOTATION: "80,http,70000",
            wk.OPAQUE_PORTS_ANNOTATION: "9000-8000",
            wk.SKIP_OUTBOUND_PORTS_ANNOTATION: "\x00" * 10_000,
        },
    )
    assert resolved.settings.skip_inbound_ports == ""
    assert resolved.settings.opaque_ports == DEFAULTS.opaque_ports
    assert len(resolved.messages) == 3
    assert "'http' is not a port or a range" in resolved.messages[1]
    assert "'70000' is outside 1-65535" in resolved.messages[1]
    # long values are cut, control characters escaped
    assert all(len(m) < 500 and m.isprintable() for m in resolved.messages)


def test_a_bad_pod_value_falls_back_to_the_namespace() -> None:
    resolved = resolve(
        DEFAULTS,
        {wk.PROXY_MEMORY_LIMIT_ANNOTATION: "64Mi"},
        {wk.PROXY_MEMORY_LIMIT_ANNOTATION: "lots"},
    )
    assert resolved.settings.resources.memory_limit == "64Mi"
    assert resolved.messages == (
        "pod annotation config.meshlet.io/proxy-memory-limit='lots' ignored: expected a quantity"
        " such as 100m, 1, 64Mi or 1Gi",
    )


def test_every_setting_is_a_config_annotation_or_linkerds_timeout() -> None:
    assert all(
        s.annotation.startswith(wk.CONFIG_ANNOTATION_PREFIX)
        or s.annotation == wk.IDLE_TIMEOUT_ANNOTATION
        for s in SETTINGS
    )
    assert len({s.annotation for s in SETTINGS}) == len(SETTINGS)


def test_an_annotation_the_proxy_would_refuse_is_ignored_and_named() -> None:
    """A duration of ten digits parses as a duration, but the proxy's loader refuses it (the
    proxy would exit 64 and the pod never start): the injector keeps the default and says so."""
    resolved = resolve(
        DEFAULTS,
        {},
        {
            wk.SHUTDOWN_GRACE_PERIOD_ANNOTATION: "1234567890s",
            wk.OUTBOUND_CONNECT_TIMEOUT_ANNOTATION: "2s",
        },
    )
    assert resolved.settings.shutdown_grace_period == DEFAULTS.shutdown_grace_period
    assert resolved.settings.outbound_connect_timeout == "2s"
    assert resolved.messages == (
        "pod annotation config.meshlet.io/proxy-shutdown-grace-period='1234567890s' ignored:"
        " expected a duration such as 500ms, 10s or 2m",
    )


def test_the_proxy_image_annotation_never_sets_the_init_image() -> None:
    """The init container runs as root with NET_ADMIN: its image is the installation's."""
    resolved = resolve(DEFAULTS, {}, {wk.PROXY_IMAGE_ANNOTATION: "evil.example/rootkit:1"})
    assert resolved.settings.image == "evil.example/rootkit:1"
    assert resolved.settings.init_image == DEFAULTS.image


def test_the_idle_timeout_annotation_opts_a_workload_in() -> None:
    assert resolve(DEFAULTS, {}, {}).settings.stream_idle_timeout == ""  # off by default
    resolved = resolve(DEFAULTS, {wk.IDLE_TIMEOUT_ANNOTATION: "5m"}, {})
    assert resolved.settings.stream_idle_timeout == "5m"
    assert resolved.inherited == {wk.IDLE_TIMEOUT_ANNOTATION: "5m"}


def test_default_inbound_policy_pod_over_namespace_over_installation() -> None:
    policy = wk.DEFAULT_INBOUND_POLICY_ANNOTATION
    installation = ProxyDefaults(default_inbound_policy="cluster-authenticated")
    assert resolve(installation, {}, {}).settings.default_inbound_policy == (
        "cluster-authenticated"
    )
    from_namespace = resolve(installation, {policy: "all-authenticated"}, {})
    assert from_namespace.settings.default_inbound_policy == "all-authenticated"
    assert from_namespace.inherited == {policy: "all-authenticated"}
    from_pod = resolve(installation, {policy: "all-authenticated"}, {policy: "deny"})
    assert from_pod.settings.default_inbound_policy == "deny"
    assert from_pod.inherited == {} and from_pod.messages == ()


@pytest.mark.parametrize("name", wk.DEFAULT_INBOUND_POLICIES)
def test_every_default_inbound_policy_name_is_accepted(name: str) -> None:
    resolved = resolve(DEFAULTS, {}, {wk.DEFAULT_INBOUND_POLICY_ANNOTATION: f" {name} "})
    assert resolved.settings.default_inbound_policy == name
    assert resolved.messages == ()


def test_a_bad_default_inbound_policy_is_dropped_with_a_warning() -> None:
    """A pod's unknown name falls back to its namespace's; a namespace's unknown name to the
    installation's. Names are Linkerd's, exactly: `Deny` and `allow` are not among them."""
    policy = wk.DEFAULT_INBOUND_POLICY_ANNOTATION
    resolved = resolve(DEFAULTS, {policy: "cluster-unauthenticated"}, {policy: "Deny"})
    assert resolved.settings.default_inbound_policy == "cluster-unauthenticated"
    assert resolved.messages == (
        f"pod annotation {policy}='Deny' ignored: expected one of all-unauthenticated,"
        " all-authenticated, cluster-unauthenticated, cluster-authenticated, deny, audit",
    )
    resolved = resolve(DEFAULTS, {policy: "allow"}, {})
    assert resolved.settings.default_inbound_policy == DEFAULTS.default_inbound_policy
    assert resolved.inherited == {}  # a refused namespace value is not copied onto the pod
    assert resolved.messages[0].startswith(f"namespace annotation {policy}='allow' ignored")
