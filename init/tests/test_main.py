"""The command's control flow, in process, with the namespace facts and the applier replaced:
what is refused, what --force and --simulate allow, and that a refused or bad command never
opens the table."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from meshlet.init import guard, main
from meshlet.init.changes import NatState, Step
from meshlet.init.guard import INITIAL_PID_NS_INO, Facts, NsId

MACHINE = NsId(4, 4026531840)
MACHINES_OWN = Facts(MACHINE, NsId(4, INITIAL_PID_NS_INO), MACHINE)
A_PODS = Facts(NsId(4, 4026532999), NsId(4, INITIAL_PID_NS_INO), MACHINE)


class FakeApplier:
    name = "fake"

    def __init__(self, ipv6: bool) -> None:
        self.ipv6 = ipv6
        self.carried_out: list[Step] = []

    def state(self) -> NatState:
        return NatState(frozenset({"PREROUTING", "OUTPUT"}))

    def carry_out(self, steps: Sequence[Step]) -> None:
        self.carried_out += steps


@pytest.fixture
def applier(monkeypatch: pytest.MonkeyPatch) -> list[FakeApplier]:
    """The appliers the command opened, in order."""
    opened: list[FakeApplier] = []

    def open_applier(mode: object, ipv6: bool = False) -> FakeApplier:
        opened.append(FakeApplier(ipv6))
        return opened[-1]

    monkeypatch.setattr(main, "_applier", open_applier)
    monkeypatch.setattr(main, "ipv6_on", lambda: False)  # tests that want IPv6 say so
    for name in list(os.environ):
        if name.startswith("MESHLET_INIT_"):
            monkeypatch.delenv(name)
    return opened


def _run(argv: list[str]) -> int:
    try:
        main.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.mark.parametrize("command", [[], ["cleanup"]])
def test_the_machines_namespace_is_refused_before_the_table_is_opened(
    monkeypatch: pytest.MonkeyPatch,
    applier: list[FakeApplier],
    command: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: MACHINES_OWN)
    assert _run(command) == main.EX_REFUSED
    assert applier == []
    assert "refusing to" in capsys.readouterr().err


def test_force_applies_in_the_machines_namespace(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: MACHINES_OWN)
    assert _run(["--force"]) == 0
    assert len(applier) == 1 and applier[0].carried_out


def test_force_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: MACHINES_OWN)
    monkeypatch.setenv("MESHLET_INIT_FORCE", "true")
    assert _run([]) == 0
    assert applier[0].carried_out


def test_a_pods_namespace_needs_no_force(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: A_PODS)
    assert _run(["--proxy-gid", "2102"]) == 0
    assert any("--gid-owner 2102" in step.line for step in applier[0].carried_out)


def test_simulate_opens_nothing_anywhere(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: MACHINES_OWN)
    assert _run(["--simulate"]) == 0
    assert applier == []
    assert capsys.readouterr().out.startswith("*nat\n")


def test_cleanup_simulate_reads_but_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: MACHINES_OWN)
    assert _run(["cleanup", "--simulate"]) == 0
    assert len(applier) == 1 and applier[0].carried_out == []


def test_bad_values_open_nothing(
    monkeypatch: pytest.MonkeyPatch, applier: list[FakeApplier]
) -> None:
    monkeypatch.setattr(guard, "read_facts", lambda: A_PODS)
    assert _run(["--proxy-uid", "root"]) == main.EX_CONFIG
    assert _run(["--no-such-flag"]) == main.EX_CONFIG
    assert applier == []


@pytest.mark.parametrize(
    ("flags", "has_ipv6", "tables"),
    [
        ([], True, [False, True]),  # auto: the namespace has IPv6, so both tables
        ([], False, [False]),  # auto: IPv6 is off in the namespace
        (["--ipv6", "true"], False, [False, True]),
        (["--ipv6", "false"], True, [False]),
    ],
)
def test_ipv6_gets_the_same_rules_in_its_own_table(
    monkeypatch: pytest.MonkeyPatch,
    applier: list[FakeApplier],
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    has_ipv6: bool,
    tables: list[bool],
) -> None:
    """IPv6 left without rules would pass around the proxy and its policy: where the namespace
    has it, the IPv6 table gets the same plan; where it has not (or --ipv6=false), the output
    says that table was left alone."""
    monkeypatch.setattr(guard, "read_facts", lambda: A_PODS)
    monkeypatch.setattr(main, "ipv6_on", lambda: has_ipv6)
    for command in ([], ["cleanup"]):
        applier.clear()
        assert _run([*command, *flags]) == 0
        assert [a.ipv6 for a in applier] == tables
        out = capsys.readouterr().out
        assert ("IPv6 nat table (fake)" in out) == (True in tables), out
        assert ("the IPv6 nat table is left as it is" in out) == (True not in tables), out
    applier.clear()
    assert _run(flags) == 0
    four, *six = applier
    assert [s.line for s in four.carried_out] == [s.line for a in six for s in a.carried_out] or (
        not six
    )


def test_simulate_prints_the_ipv6_table_unless_told_not_to(
    applier: list[FakeApplier], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["--simulate", "--subnets-to-ignore", "10.96.0.0/12,fd00:10:96::/112"]) == 0
    four, six = capsys.readouterr().out.split(
        "# ip6tables (where the network namespace has IPv6):\n"
    )
    assert "-d 10.96.0.0/12 " in four and "fd00" not in four
    assert "-d fd00:10:96::/112 " in six and "10.96" not in six
    assert _run(["--simulate", "--ipv6", "false"]) == 0
    assert "ip6tables" not in capsys.readouterr().out
    assert applier == []
