"""The refusal to change the machine's own network namespace: the decision, then the real command
run where the tests run (the machine's namespace on CI) and in a container-like PID namespace."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from meshlet.init.guard import INITIAL_PID_NS_INO, Facts, NsId, Where, read_facts, refusal, where

Run = Callable[..., subprocess.CompletedProcess[str]]
INIT = str(Path(sys.executable).with_name("meshlet-init"))
HOST, POD = NsId(4, 4026531840), NsId(4, 4026532999)
INITIAL_PID, CONTAINER_PID = NsId(4, INITIAL_PID_NS_INO), NsId(4, 4026533000)


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (Facts(HOST, INITIAL_PID, HOST), Where.MACHINE),
        (Facts(POD, INITIAL_PID, HOST), Where.OWN),
        (Facts(POD, INITIAL_PID, None, "unreadable"), Where.UNKNOWN),
        (Facts(POD, CONTAINER_PID, POD), Where.CONTAINER),  # PID 1 is the container's own
        (Facts(HOST, CONTAINER_PID, None), Where.CONTAINER),
        (Facts(None, None, None, "/proc/self/ns/net: No such file or directory"), Where.UNKNOWN),
    ],
)
def test_where(facts: Facts, expected: Where) -> None:
    assert where(facts) is expected
    message = refusal(facts, cleanup=False, inbound_port=4143, outbound_port=4140)
    assert (message is None) == expected.allowed


def test_refusals_say_why_and_what_to_do() -> None:
    applying = refusal(Facts(HOST, INITIAL_PID, HOST), False, 14143, 14140)
    assert applying is not None
    assert "refusing to apply: this is the machine's own network namespace" in applying
    assert "redirect all of this machine's outbound TCP to port 14140" in applying
    assert "`ip netns exec <ns> meshlet-init`, or pass --force" in applying
    cleaning = refusal(Facts(HOST, INITIAL_PID, HOST), True, 4143, 4140)
    assert cleaning is not None
    assert "refusing to clean up" in cleaning and "meshlet-init cleanup" in cleaning
    hidden = Facts(POD, INITIAL_PID, None, "/proc/1/ns/net: Permission denied")
    unsure = refusal(hidden, False, 1, 2)
    assert unsure is not None
    assert "cannot tell" in unsure and "/proc/1/ns/net: Permission denied" in unsure


def _require_machine_netns() -> None:
    """These tests need to run in the machine's own network namespace, as CI's do; checked here
    without the code under test: same namespace as PID 1, or as kthreadd when PID 1's is hidden."""
    own = os.stat("/proc/self/ns/net")
    for pid in ("1", "2"):
        try:
            other = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (own.st_dev, own.st_ino) == (other.st_dev, other.st_ino):
            return
        break
    problem = "this test process does not run in the machine's own network namespace"
    if os.environ.get("MESHLET_REQUIRE_NETNS") == "1":
        pytest.fail(f"{problem} (MESHLET_REQUIRE_NETNS=1)")
    pytest.skip(problem)


def _saved() -> tuple[str, str]:
    def save(tool: str) -> str:
        out = subprocess.run([tool, "-t", "nat"], capture_output=True, text=True, check=True)
        return "\n".join(line for line in out.stdout.splitlines() if not line.startswith("#"))

    return save("iptables-legacy-save"), save("iptables-nft-save")


# Were the guard broken, these settings would still redirect nothing: every port is ignored.
HARMLESS = ("--inbound-ports-to-ignore", "1-65535", "--outbound-ports-to-ignore", "1-65535")


@pytest.mark.netns
@pytest.mark.parametrize(("command", "verb"), [((), "apply"), (("cleanup",), "clean up")])
@pytest.mark.parametrize("mode", ["legacy", "nft"])
def test_the_real_command_refuses_the_machines_namespace(
    netns_available: None, command: tuple[str, ...], verb: str, mode: str
) -> None:
    _require_machine_netns()
    before = _saved()
    result = subprocess.run(
        [INIT, *command, "--mode", mode, *HARMLESS], capture_output=True, text=True, timeout=30
    )
    try:
        assert result.returncode == 77, result
        assert f"refusing to {verb}: this is the machine's own network namespace" in result.stderr
        assert "ip netns exec <ns> meshlet-init" in result.stderr
        assert "or pass --force" in result.stderr
        assert result.stdout == ""
        assert _saved() == before
    finally:
        if result.returncode == 0 and not command:  # undo what a broken guard let through
            subprocess.run([INIT, "cleanup", "--force", "--mode", mode], check=False)


@pytest.mark.netns
def test_simulate_is_allowed_in_the_machines_namespace(netns_available: None) -> None:
    _require_machine_netns()
    before = _saved()
    result = subprocess.run([INIT, "--simulate"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("*nat\n:PROXY_INIT_REDIRECT - [0:0]\n")
    assert _saved() == before


@pytest.mark.netns
def test_a_pods_namespace_is_allowed(netns: Run) -> None:
    result = netns(INIT, check=False)
    assert result.returncode == 0, result.stderr
    assert "PROXY_INIT_OUTPUT" in netns("iptables-legacy-save", "-t", "nat").stdout


@pytest.mark.netns
def test_a_container_with_its_own_pid_namespace_is_allowed(netns: Run) -> None:
    """As a Kubernetes init container: PID 1 is the container's, in the pod's namespace."""
    result = netns("unshare", "--pid", "--fork", "--mount-proc", INIT, "--mode", "nft", check=False)
    assert result.returncode == 0, result.stderr
    assert "PROXY_INIT_OUTPUT" in netns("iptables-nft-save", "-t", "nat").stdout


def test_read_facts_sees_this_process() -> None:
    facts = read_facts()
    own = os.stat("/proc/self/ns/net")
    assert facts.own_net == NsId(own.st_dev, own.st_ino)


def test_without_proc_it_cannot_tell(tmp_path: Path) -> None:
    facts = read_facts(tmp_path)
    assert where(facts) is Where.UNKNOWN
    message = refusal(facts, False, 4143, 4140)
    assert message is not None and "self/ns/net: No such file or directory" in message
