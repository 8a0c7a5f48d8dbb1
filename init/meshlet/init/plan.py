"""The iptables plan (pure): which nat rules route a pod's TCP through its proxy.

The plan is `iptables-restore` input for the nat table. Our chains are declared, which flushes
them when they exist, so applying the plan twice leaves one copy of every rule; the jumps from
PREROUTING and OUTPUT are only added when the current ruleset lacks them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from meshlet.api import wellknown

REDIRECT_CHAIN: Final = "PROXY_INIT_REDIRECT"
OUTPUT_CHAIN: Final = "PROXY_INIT_OUTPUT"
COMMENT_PREFIX: Final = "meshlet-init/"
MULTIPORT_MAX: Final = 15  # ports per multiport match; a range counts as two


class PlanError(ValueError):
    """Bad settings; the message lists every one."""


@dataclass(frozen=True, slots=True)
class InitConfig:
    inbound_port: int = wellknown.PROXY_INBOUND_PORT
    outbound_port: int = wellknown.PROXY_OUTBOUND_PORT
    proxy_uid: int = wellknown.PROXY_UID
    proxy_gid: int | None = None
    # Ports or ranges ("4190", "5000-5010") not redirected to the proxy.
    skip_inbound_ports: tuple[str, ...] = field(
        default=(str(wellknown.PROXY_CONTROL_PORT), str(wellknown.PROXY_ADMIN_PORT))
    )
    skip_outbound_ports: tuple[str, ...] = ()


def parse_ports(text: str) -> tuple[str, ...]:
    """`"25, 587,4000-4010"` → ("25", "587", "4000:4010") in iptables syntax."""
    ports: list[str] = []
    errors: list[str] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            errors.append(f"{item!r} is not a port or a range")
            continue
        lo, hi = int(low), int(high or low)
        if not 1 <= lo <= hi <= 65535:
            errors.append(f"{item!r} is outside 1-65535 or reversed")
            continue
        ports.append(str(lo) if lo == hi else f"{lo}:{hi}")
    if errors:
        raise PlanError("; ".join(errors))
    return tuple(ports)


def _chunks(ports: Sequence[str]) -> Iterable[list[str]]:
    chunk: list[str] = []
    weight = 0
    for port in ports:
        cost = 2 if ":" in port else 1
        if weight + cost > MULTIPORT_MAX:
            yield chunk
            chunk, weight = [], 0
        chunk.append(port)
        weight += cost
    if chunk:
        yield chunk


def _rule(chain: str, match: str, purpose: str, target: str) -> str:
    match = f"{match} " if match else ""
    return f'-A {chain} {match}-m comment --comment "{COMMENT_PREFIX}{purpose}" -j {target}'


def _skips(chain: str, ports: Sequence[str], direction: str) -> list[str]:
    return [
        _rule(
            chain,
            f"-p tcp -m multiport --dports {','.join(chunk)}",
            f"ignore-{direction}-ports-{','.join(chunk)}",
            "RETURN",
        )
        for chunk in _chunks(ports)
    ]


def plan(config: InitConfig, current: str = "") -> list[str]:
    """iptables-restore lines; `current` is `iptables-save -t nat` output (for idempotence)."""
    lines = ["*nat", f":{REDIRECT_CHAIN} - [0:0]", f":{OUTPUT_CHAIN} - [0:0]"]
    lines += _skips(REDIRECT_CHAIN, config.skip_inbound_ports, "inbound")
    lines.append(
        _rule(
            REDIRECT_CHAIN,
            "-p tcp",
            "redirect-all-incoming-to-proxy-port",
            f"REDIRECT --to-ports {config.inbound_port}",
        )
    )
    lines.append(
        _rule(
            OUTPUT_CHAIN, f"-m owner --uid-owner {config.proxy_uid}", "ignore-proxy-uid", "RETURN"
        )
    )
    if config.proxy_gid is not None:
        lines.append(
            _rule(
                OUTPUT_CHAIN,
                f"-m owner --gid-owner {config.proxy_gid}",
                "ignore-proxy-gid",
                "RETURN",
            )
        )
    lines.append(_rule(OUTPUT_CHAIN, "-o lo", "ignore-loopback", "RETURN"))
    lines += _skips(OUTPUT_CHAIN, config.skip_outbound_ports, "outbound")
    lines.append(
        _rule(
            OUTPUT_CHAIN,
            "-p tcp",
            "redirect-all-outgoing-to-proxy-port",
            f"REDIRECT --to-ports {config.outbound_port}",
        )
    )
    for parent, chain, purpose in (
        ("PREROUTING", REDIRECT_CHAIN, "install-proxy-init-prerouting"),
        ("OUTPUT", OUTPUT_CHAIN, "install-proxy-init-output"),
    ):
        jump = _rule(parent, "", purpose, chain)
        if jump not in current:
            lines.append(jump)
    lines.append("COMMIT")
    return lines
