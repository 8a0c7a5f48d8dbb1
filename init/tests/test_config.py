"""meshlet-init's settings from a dict of texts: defaults, every value, every problem at once."""

from __future__ import annotations

from ipaddress import IPv4Network

import pytest

from meshlet.api.ports import parse_ports
from meshlet.init.config import FLAGS, ConfigError, Mode, load
from meshlet.init.plan import InitConfig


def test_defaults_are_the_well_known_values() -> None:
    settings = load({})
    assert settings.config == InitConfig()
    assert (settings.mode, settings.simulate, settings.force) == (Mode.LEGACY, False, False)


def test_every_value() -> None:
    settings = load(
        {
            "incoming-proxy-port": "14143",
            "outgoing-proxy-port": " 14140 ",
            "proxy-uid": "0",
            "proxy-gid": "2102",
            "inbound-ports-to-ignore": "22, 8000-8010,4191",
            "outbound-ports-to-ignore": "25,587,4000-4010",
            "subnets-to-ignore": "10.96.0.0/12, 192.0.2.7,10.96.0.0/12",
            "mode": "NFT",
            "simulate": "yes",
            "force": "1",
        }
    )
    assert settings.config == InitConfig(
        inbound_port=14143,
        outbound_port=14140,
        proxy_uid=0,
        proxy_gid=2102,
        skip_inbound_ports=parse_ports("4190,4191,22,8000-8010"),
        skip_outbound_ports=parse_ports("25,587,4000-4010"),
        skip_subnets=(IPv4Network("10.96.0.0/12"), IPv4Network("192.0.2.7/32")),
    )
    assert (settings.mode, settings.simulate, settings.force) == (Mode.NFT, True, True)


def test_an_empty_gid_means_none() -> None:
    assert load({"proxy-gid": " "}).config.proxy_gid is None


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        load(
            {
                "incoming-proxy-port": "0",
                "outgoing-proxy-port": "65536",
                "proxy-uid": "-1",
                "proxy-gid": "4294967295",
                "inbound-ports-to-ignore": "x",
                "outbound-ports-to-ignore": "9-3,70000",
                "subnets-to-ignore": "10.1.2.3/8,fd00::1/8,nope,10.0.0.0/33",
                "ipv6": "sometimes",
                "mode": "iptables",
                "simulate": "maybe",
                "force": "2",
            }
        )
    problems = error.value.problems
    assert [p.split(" ", 1)[0] for p in problems] == [flag.option for flag in FLAGS]
    text = str(error.value)
    for expected in (
        "--incoming-proxy-port (MESHLET_INIT_INCOMING_PROXY_PORT): '0' is not a port (1-65535)",
        "'65536' is not a port",
        "'-1' is not a numeric ID (0-4294967294)",
        "'4294967295' is not a numeric ID",
        "'x' is not a port or a range",
        "'9-3' is a reversed range",
        "'70000' is outside 1-65535",
        "'10.1.2.3/8' has host bits set (the network is 10.0.0.0/8)",
        "'fd00::1/8' has host bits set (the network is fd00::/8)",
        "'nope' is not a network",
        "'10.0.0.0/33' is not a network",
        "--ipv6 (MESHLET_INIT_IPV6): 'sometimes' is not auto, true or false",
        "'iptables' is not a mode (one of legacy, nft)",
        "'maybe' is not true or false",
        "--force (MESHLET_INIT_FORCE): '2' is not true or false",
    ):
        assert expected in text


def test_every_flag_has_help_and_an_env_name() -> None:
    for flag in FLAGS:
        assert flag.help and flag.option == f"--{flag.name}"
        assert flag.env == "MESHLET_INIT_" + flag.name.upper().replace("-", "_")
    names = {flag.name for flag in FLAGS}
    linkerd = {"incoming-proxy-port", "outgoing-proxy-port", "proxy-uid", "proxy-gid",
               "inbound-ports-to-ignore", "outbound-ports-to-ignore", "subnets-to-ignore",
               "simulate"}  # fmt: skip
    assert linkerd <= names
