"""meshlet-init against real iptables inside a network namespace made by the test."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]
INIT = [sys.executable, "-m", "meshlet.init.main"]


@pytest.mark.netns
def test_apply_is_idempotent(netns: Run) -> None:
    netns(*INIT, "--mode", "legacy", "--proxy-gid", "2102", "--outbound-ports-to-ignore", "443")
    netns(*INIT, "--mode", "legacy", "--proxy-gid", "2102", "--outbound-ports-to-ignore", "443")
    saved = netns("iptables-legacy-save", "-t", "nat").stdout
    rules = [line for line in saved.splitlines() if line.startswith("-A")]
    assert len(rules) == len(set(rules)), saved
    assert (
        '-A PREROUTING -m comment --comment "meshlet-init/install-proxy-init-prerouting"'
        " -j PROXY_INIT_REDIRECT"
    ) in rules
    assert any("--uid-owner 2102" in r and "RETURN" in r for r in rules)
    assert any("--gid-owner 2102" in r and "RETURN" in r for r in rules)
    assert any("--dports 443" in r for r in rules)
    assert any("REDIRECT --to-ports 4140" in r for r in rules)
    assert any("REDIRECT --to-ports 4143" in r for r in rules)


@pytest.mark.netns
def test_bad_ports_change_nothing(netns: Run) -> None:
    result = netns(*INIT, "--inbound-ports-to-ignore", "70000", check=False)
    assert result.returncode == 64
    assert "outside 1-65535" in result.stderr
    saved = netns("iptables-legacy-save", "-t", "nat").stdout
    assert "PROXY_INIT" not in saved
