"""The proxy's environment table: defaults, parsing, every error at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.proxy.config import ConfigError, IdentitySettings, ProxyConfig, defaults_table, load

WEB = wellknown.identity_name("web", "emojivoto")


def test_defaults() -> None:
    config = load({})
    assert config == ProxyConfig()
    assert config.inbound_listen_addr == ("0.0.0.0", 4143)
    assert config.outbound_listen_addr == ("127.0.0.1", 4140)
    assert 3306 in config.inbound_ports_disable_protocol_detection
    assert config.outbound_detect_timeout == 10.0


def test_values_are_parsed() -> None:
    config = load(
        {
            "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:15001",
            "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "[::]:15006",
            "MESHLET_PROXY_INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION": "25,5000-5002",
            "MESHLET_PROXY_OUTBOUND_CONNECT_TIMEOUT": "250ms",
            "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "2m",
            "MESHLET_PROXY_LOG": "warn",
            "UNRELATED": "ignored",
        }
    )
    assert config.outbound_listen_addr == ("127.0.0.1", 15001)
    assert config.inbound_listen_addr == ("::", 15006)
    assert str(config.inbound_ports_disable_protocol_detection) == "25,5000-5002"
    assert config.outbound_connect_timeout == 0.25
    assert config.shutdown_grace_period == 120.0
    assert config.log == "warning"


def test_every_bad_key_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        load(
            {
                "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "localhost:80",
                "MESHLET_PROXY_INBOUND_DETECT_TIMEOUT": "soon",
                "MESHLET_PROXY_INBOUND_PORTS_REQUIRE_IDENTITY": "0",
                "MESHLET_PROXY_HTTP1_MAX_HEADERS": "-3",
                "MESHLET_PROXY_NO_SUCH_THING": "1",
                "MESHLET_PROXY_IDENTITY_SVC_ADDR": "127.0.0.1:8080",
            }
        )
    problems = "\n".join(caught.value.problems)
    for name in (
        "OUTBOUND_LISTEN_ADDR",
        "INBOUND_DETECT_TIMEOUT",
        "INBOUND_PORTS_REQUIRE_IDENTITY",
        "HTTP1_MAX_HEADERS",
        "NO_SUCH_THING: unknown setting",
        "IDENTITY_LOCAL_NAME is required with identity",
        "IDENTITY_TOKEN_FILE is required with identity",
        "IDENTITY_TRUST_ANCHORS: the trust anchors (PEM text) are required",
    ):
        assert name in problems
    assert len(caught.value.problems) == 8


def test_defaults_table_lists_every_setting() -> None:
    names = [name for name, _ in defaults_table()]
    assert "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR" in names
    assert len(names) == len(set(names)) >= 25


def test_defaults_are_shown_as_they_are_written_in_the_environment() -> None:
    table = dict(defaults_table())
    assert table["MESHLET_PROXY_INBOUND_LISTEN_ADDR"] == "0.0.0.0:4143"
    assert table["MESHLET_PROXY_INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION"] == (
        "25,587,3306,4444,5432,6379,9300,11211"
    )
    assert table["MESHLET_PROXY_INBOUND_PORTS_REQUIRE_IDENTITY"] == "none"
    assert table["MESHLET_PROXY_OUTBOUND_CONNECT_TIMEOUT"] == "1s"
    assert table["MESHLET_PROXY_DESTINATION_PROFILE_SUFFIXES"] == "svc.cluster.local"
    assert table["MESHLET_PROXY_IDENTITY_DIR"] == "unset"
    assert table["MESHLET_PROXY_ADMIN_SHUTDOWN_ENABLED"] == "false"
    for name, text in table.items():  # each default parses back to itself
        if text not in ("unset", "none"):
            assert load({name: text}) == ProxyConfig(), name


# -- identity and discovery settings: checked by the one loader --------------------------------

E = wellknown.ProxyEnv


def test_no_identity_settings_means_no_identity_and_no_discovery() -> None:
    config = load({})
    assert config.identity is None and config.destination is None


def test_identity_settings_from_the_environment(tmp_path: Path, test_ca: Any) -> None:
    config = load(
        {
            E.IDENTITY_SVC_ADDR: "meshlet-identity.meshlet.svc.cluster.local:8080",
            E.IDENTITY_LOCAL_NAME: WEB,
            E.IDENTITY_TOKEN_FILE: "/var/run/secrets/tokens/meshlet-identity-token",
            E.IDENTITY_TRUST_ANCHORS: test_ca.anchors_pem,
            E.IDENTITY_TRUST_ANCHORS_FILE: "/var/run/meshlet/trust-roots/ca-bundle.crt",
            E.IDENTITY_DIR: "/var/run/meshlet/identity",
            E.DESTINATION_SVC_ADDR: "[fd00::10]:8086",
            E.DESTINATION_SVC_NAME: wellknown.DESTINATION_SERVICE_NAME,
        }
    )
    assert config.identity == IdentitySettings(
        local_name=WEB,
        svc_addr=HostPort("meshlet-identity.meshlet.svc.cluster.local", 8080),
        svc_name=wellknown.IDENTITY_SERVICE_NAME,  # the default
        token_file=Path("/var/run/secrets/tokens/meshlet-identity-token"),
        trust_anchors_pem=test_ca.anchors_pem,
        directory=Path("/var/run/meshlet/identity"),
        trust_anchors_file=Path("/var/run/meshlet/trust-roots/ca-bundle.crt"),
    )
    assert config.destination is not None
    assert config.destination.svc_addr == ("fd00::10", 8086)
    assert config.destination.trust_anchors_pem == test_ca.anchors_pem
    assert config.destination.namespace is None  # no context token


@pytest.mark.parametrize(
    ("context", "namespace"),
    [
        ('{"ns":"shop","nodeName":"n1","pod":"web-1"}', "shop"),
        ('{"ns":"","pod":"web-1"}', None),
        ('["shop"]', None),
        ("not json", None),
    ],
)
def test_the_pods_namespace_comes_from_its_context_token(
    context: str, namespace: str | None
) -> None:
    """What completes a Service's short name (`web` → `web.<ns>.svc.cluster.local`)."""
    config = load({
        E.DESTINATION_SVC_ADDR: "10.96.0.5:8086", E.DESTINATION_CONTEXT: context,
    })  # fmt: skip
    assert config.destination is not None
    assert config.destination.namespace == namespace


@pytest.mark.parametrize(("value", "parsed"), [("127.1.77.12", "127.1.77.12"),
                                              (" fd00::0:1 ", "fd00::1")])  # fmt: skip
def test_the_mesh_source_address_is_an_ip(value: str, parsed: str) -> None:
    assert load({E.OUTBOUND_MESH_SOURCE_IP: value}).outbound_mesh_source_ip == parsed
    with pytest.raises(ConfigError) as caught:
        load({E.OUTBOUND_MESH_SOURCE_IP: "pod-1"})
    assert f"{E.OUTBOUND_MESH_SOURCE_IP}='pod-1': 'pod-1' is not an IP address" in str(caught.value)


def test_every_problem_is_reported_together() -> None:
    with pytest.raises(ConfigError) as caught:
        load(
            {
                E.IDENTITY_SVC_ADDR: "identity:http",
                E.IDENTITY_LOCAL_NAME: WEB,
                E.IDENTITY_TRUST_ANCHORS: "/var/run/meshlet/ca-bundle.crt",
                E.DESTINATION_SVC_ADDR: "destination",
                E.INBOUND_PORTS_REQUIRE_IDENTITY: "8080,x,70000",
                E.LOG_FORMAT: "xml",
            }
        )
    problems = " | ".join(caught.value.problems)
    assert len(caught.value.problems) == 6, problems
    assert f"{E.IDENTITY_SVC_ADDR}='identity:http'" in problems and "is not a port" in problems
    assert f"{E.IDENTITY_TOKEN_FILE} is required" in problems
    assert f"{E.IDENTITY_TRUST_ANCHORS}: not PEM certificates" in problems
    assert "holds the certificates themselves, not a path" in problems
    assert f"{E.DESTINATION_SVC_ADDR}='destination'" in problems and "has no port" in problems
    assert "'x' is not a port or a range" in problems and "'70000' is outside" in problems
    assert f"{E.LOG_FORMAT}='xml': expected plain or json" in problems


def test_a_destination_name_needs_an_address_and_anchors() -> None:
    with pytest.raises(ConfigError) as caught:
        load({E.DESTINATION_SVC_NAME: wellknown.DESTINATION_SERVICE_NAME})
    assert caught.value.problems == [f"{E.DESTINATION_SVC_NAME} needs {E.DESTINATION_SVC_ADDR}"]
    with pytest.raises(ConfigError, match="needs MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"):
        load({E.DESTINATION_SVC_ADDR: "d:8086", E.DESTINATION_SVC_NAME: "x"})
    # without identity the anchors are still checked, for the destination's TLS
    with pytest.raises(ConfigError, match="not a path to them"):
        load({E.DESTINATION_SVC_ADDR: "d:8086", E.DESTINATION_SVC_NAME: "x",
              E.IDENTITY_TRUST_ANCHORS: "/etc/ca.pem"})  # fmt: skip


def test_port_lists_use_the_one_grammar() -> None:
    config = load({E.INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION: "25, 4000-4010"})
    ports = config.inbound_ports_disable_protocol_detection
    assert 25 in ports and 4005 in ports and 4011 not in ports and 3306 not in ports
    assert 3306 in load({}).inbound_ports_disable_protocol_detection  # the defaults


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({E.IDENTITY_SVC_ADDR: "i:8080", E.IDENTITY_LOCAL_NAME: "x",
          E.IDENTITY_TOKEN_FILE: "/t", E.IDENTITY_TRUST_ANCHORS: "/etc/ca.pem"},
         "not a path to them"),
        ({E.DESTINATION_SVC_ADDR: "nowhere"}, "has no port"),
    ],
)  # fmt: skip
def test_the_command_exits_64_naming_the_problem_without_a_traceback(
    env: dict[str, str], says: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshlet.proxy.main"],
        env={"PATH": "/usr/bin:/bin", **{str(k): v for k, v in env.items()}},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 64
    assert says in result.stderr
    assert "Traceback" not in result.stderr


def test_kubernetes_service_links_are_not_settings() -> None:
    """What the kubelet gave a control-plane pod for the Service meshlet-proxy-injector (the
    namespace's Services become variables of every container): no proxy setting, whatever the
    prefix. A misspelt setting whose name ends the same way is still refused."""
    links = {
        "MESHLET_PROXY_INJECTOR_SERVICE_HOST": "10.43.86.111",
        "MESHLET_PROXY_INJECTOR_SERVICE_PORT": "443",
        "MESHLET_PROXY_INJECTOR_SERVICE_PORT_WEBHOOK": "443",
        "MESHLET_PROXY_INJECTOR_PORT": "tcp://10.43.86.111:443",
        "MESHLET_PROXY_INJECTOR_PORT_443_TCP": "tcp://10.43.86.111:443",
        "MESHLET_PROXY_INJECTOR_PORT_443_TCP_PROTO": "tcp",
        "MESHLET_PROXY_INJECTOR_PORT_443_TCP_PORT": "443",
        "MESHLET_PROXY_INJECTOR_PORT_443_TCP_ADDR": "10.43.86.111",
        "MESHLET_PROXY_V6_SERVICE_HOST": "fd00:43::1a",
    }
    assert load(links) == load({})
    with pytest.raises(ConfigError) as caught:
        load({**links, "MESHLET_PROXY_ADMIN_PORT": "4191",
                     "MESHLET_PROXY_ADMIN_SERVICE_HOST": "localhost"})  # fmt: skip
    assert sorted(caught.value.problems) == [
        "MESHLET_PROXY_ADMIN_PORT: unknown setting",
        "MESHLET_PROXY_ADMIN_SERVICE_HOST: unknown setting",
    ]
