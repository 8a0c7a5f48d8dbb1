"""The proxy's environment table: defaults, parsing, every error at once."""

from __future__ import annotations

import pytest

from meshlet.proxy.config import ConfigError, ProxyConfig, defaults_table, load


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
    assert config.inbound_ports_disable_protocol_detection == frozenset({25, 5000, 5001, 5002})
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
        "IDENTITY_LOCAL_NAME go together",
    ):
        assert name in problems
    assert len(caught.value.problems) == 6


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
