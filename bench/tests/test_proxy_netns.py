"""The REDIRECT that sends the bench's TCP client to the proxy under test, as a command."""

from __future__ import annotations

from bench.proxy_netns import CLIENT_GID, redirect_rule


def test_the_rule_matches_only_the_clients_group_and_the_upstream() -> None:
    assert redirect_rule("-A", "127.0.0.3", 5201, 4140) == [
        "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.3",
        "--dport", "5201", "-m", "owner", "--gid-owner", str(CLIENT_GID),
        "-j", "REDIRECT", "--to-ports", "4140",
    ]  # fmt: skip


def test_deleting_names_the_same_rule() -> None:
    added, deleted = (redirect_rule(action, "127.0.0.1", 1, 2) for action in ("-A", "-D"))
    assert added[:3] + added[4:] == deleted[:3] + deleted[4:]
