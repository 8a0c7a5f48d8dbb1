"""meshlet-init's settings: one table of flags, each also read from `MESHLET_INIT_<FLAG>`, parsed
once into `Settings` with every problem reported together.

Flag names follow Linkerd's proxy-init. A value given on the command line wins over the
environment, which wins over the default. Tests pass a dict of texts to `load`.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Final, TypeVar

from meshlet.api import wellknown
from meshlet.api.ports import parse_ports
from meshlet.init.plan import ALWAYS_SKIPPED_INBOUND, NO_PORTS, InitConfig

T = TypeVar("T")

MAX_ID: Final = 2**32 - 2  # 2**32 - 1 is (uid_t) -1, "no owner"


class Mode(enum.Enum):
    LEGACY = "legacy"  # python-iptables, legacy tables
    NFT = "nft"  # iptables-nft-restore


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # the flag without its dashes
    default: str
    help: str
    metavar: str = ""  # empty for a switch (a flag without a value)

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def env(self) -> str:
        return wellknown.INIT_ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def switch(self) -> bool:
        return not self.metavar


FLAGS: Final = (
    Flag(
        "incoming-proxy-port",
        str(wellknown.PROXY_INBOUND_PORT),
        "port of the proxy's inbound listener, where incoming TCP is redirected",
        "PORT",
    ),
    Flag(
        "outgoing-proxy-port",
        str(wellknown.PROXY_OUTBOUND_PORT),
        "port of the proxy's outbound listener, where the pod's outgoing TCP is redirected",
        "PORT",
    ),
    Flag(
        "proxy-uid",
        str(wellknown.PROXY_UID),
        "user ID the proxy runs as; its connections leave the pod unredirected",
        "UID",
    ),
    Flag(
        "proxy-gid",
        "",
        "group ID the proxy runs as, when set; connections of processes with this group leave"
        " unredirected too (the local mesh runs the proxy with GID 2102)",
        "GID",
    ),
    Flag(
        "inbound-ports-to-ignore",
        "",
        f"incoming ports not redirected to the proxy, besides {ALWAYS_SKIPPED_INBOUND}"
        " (e.g. 22,8000-8010)",
        "PORTS",
    ),
    Flag(
        "outbound-ports-to-ignore",
        "",
        "destination ports of outgoing TCP not redirected to the proxy (e.g. 25,587,4000-4010)",
        "PORTS",
    ),
    Flag(
        "subnets-to-ignore",
        "",
        "networks (CIDRs, IPv4 or IPv6) whose outgoing traffic is not redirected to the proxy"
        " (e.g. 10.96.0.0/12,192.0.2.7/32,fd00:10:96::/112)",
        "CIDRS",
    ),
    Flag(
        "mode",
        Mode.LEGACY.value,
        "legacy: python-iptables on the legacy tables; nft: iptables-nft-restore",
        "legacy|nft",
    ),
    Flag(
        "simulate",
        "false",
        "print the rules (apply) or the changes (cleanup) and change nothing; allowed anywhere",
    ),
    Flag(
        "force",
        "false",
        "apply or clean up even in the machine's own network namespace",
    ),
    Flag(
        "ipv6",
        "auto",
        "program the IPv6 nat table (ip6tables) too: true, false, or auto (when the network"
        " namespace has IPv6; IPv6 traffic left unredirected would bypass the proxy)",
        "auto|true|false",
    ),
)
BY_NAME: Final = {flag.name: flag for flag in FLAGS}


@dataclass(frozen=True, slots=True)
class Settings:
    config: InitConfig
    mode: Mode
    simulate: bool
    force: bool
    ipv6: bool | None = None  # None: auto, when the namespace has IPv6


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


def load(values: Mapping[str, str]) -> Settings:
    """`values`: flag name (`proxy-gid`) → text; a missing name takes its default. ConfigError
    names every bad value."""
    problems: list[str] = []

    def take(name: str, parse: Callable[[str], T], fallback: T) -> T:
        flag = BY_NAME[name]
        try:
            return parse(values.get(name, flag.default))
        except ValueError as exc:
            problems.append(f"{flag.option} ({flag.env}): {exc}")
            return fallback

    config = InitConfig(
        inbound_port=take("incoming-proxy-port", _port, 0),
        outbound_port=take("outgoing-proxy-port", _port, 0),
        proxy_uid=take("proxy-uid", _id, 0),
        proxy_gid=take("proxy-gid", _optional_id, None),
        skip_inbound_ports=ALWAYS_SKIPPED_INBOUND.union(
            take("inbound-ports-to-ignore", parse_ports, ALWAYS_SKIPPED_INBOUND)
        ),
        skip_outbound_ports=take("outbound-ports-to-ignore", parse_ports, NO_PORTS),
        skip_subnets=take("subnets-to-ignore", _subnets, ()),
    )
    settings = Settings(
        config=config,
        mode=take("mode", _mode, Mode.LEGACY),
        simulate=take("simulate", _switch, False),
        force=take("force", _switch, False),
        ipv6=take("ipv6", _auto_switch, None),
    )
    if problems:
        raise ConfigError(problems)
    return settings


_NUMBER = re.compile(r"\s*([0-9]{1,10})\s*")


def _number(text: str, low: int, high: int, what: str) -> int:
    match = _NUMBER.fullmatch(text)
    if match is None or not low <= int(match[1]) <= high:
        raise ValueError(f"{text!r} is not {what} ({low}-{high})")
    return int(match[1])


def _port(text: str) -> int:
    return _number(text, 1, 65535, "a port")


def _id(text: str) -> int:
    return _number(text, 0, MAX_ID, "a numeric ID")


def _optional_id(text: str) -> int | None:
    return None if not text.strip() else _id(text)


def _subnets(text: str) -> tuple[IPv4Network | IPv6Network, ...]:
    subnets: list[IPv4Network | IPv6Network] = []
    errors: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            network = ipaddress.ip_network(item, strict=False)
        except ValueError:
            errors.append(f"{item!r} is not a network (e.g. 10.96.0.0/12 or fd00::/8)")
            continue
        if network.network_address != ipaddress.ip_address(item.partition("/")[0]):
            errors.append(f"{item!r} has host bits set (the network is {network})")
        else:
            subnets.append(network)
    if errors:
        raise ValueError("; ".join(errors))
    return tuple(dict.fromkeys(subnets))


def _mode(text: str) -> Mode:
    try:
        return Mode(text.strip().lower())
    except ValueError:
        raise ValueError(
            f"{text!r} is not a mode (one of {', '.join(m.value for m in Mode)})"
        ) from None


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})


def _auto_switch(text: str) -> bool | None:
    """True, False, or None for `auto` (or nothing)."""
    word = text.strip().lower()
    if word in ("", "auto"):
        return None
    if word in _TRUE | _FALSE:
        return word in _TRUE
    raise ValueError(f"{text!r} is not auto, true or false")


def _switch(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE | _FALSE:
        return word in _TRUE
    raise ValueError(f"{text!r} is not true or false")
