"""Both appliers against real iptables inside network namespaces made by the tests: the table read
back holds exactly the plan's rules, once; other settings replace them; cleanup restores the
table as it was; bad values change nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from meshlet.init.plan import Plan, plan
from meshlet.init.save import parse_save

Run = Callable[..., subprocess.CompletedProcess[str]]
INIT = str(Path(sys.executable).with_name("meshlet-init"))
MODES = ["legacy", "nft"]

# Someone else's rules, there before meshlet-init and to be there after its cleanup.
UNRELATED = """\
*nat
:KEEP_ME - [0:0]
-A PREROUTING -s 198.51.100.0/24 -j RETURN
-A OUTPUT -d 192.0.2.1/32 -p udp -j RETURN
-A POSTROUTING -j KEEP_ME
-A KEEP_ME -o lo -j RETURN
COMMIT
"""

# (flags, the same settings as meshlet-init builds them from the flags)
SETTINGS: dict[str, list[str]] = {
    "default": [],
    "local-mesh": ["--proxy-gid", "2102", "--inbound-ports-to-ignore", "22",
                   "--outbound-ports-to-ignore", "443,5000-5010"],
    "everything": ["--incoming-proxy-port", "14143", "--outgoing-proxy-port", "14140",
                   "--proxy-uid", "1337", "--proxy-gid", "1338",
                   "--inbound-ports-to-ignore", "8000-8010",
                   "--outbound-ports-to-ignore", ",".join(str(p) for p in range(1000, 1017))
                   + ",2000-2010",
                   "--subnets-to-ignore", "10.96.0.0/12,192.0.2.7/32"],
}  # fmt: skip


def _plan(flags: list[str]) -> Plan:
    """The plan of these flags, computed as --simulate prints it (no iptables involved)."""
    from meshlet.init.config import load
    from meshlet.init.main import _values, parser

    return plan(load(_values(parser().parse_args(flags), {})).config)


def _saved(netns: Run, mode: str) -> str:
    """`iptables-save -t nat` without its comment lines and counters."""
    text = netns(f"iptables-{mode}-save", "-t", "nat").stdout
    return "\n".join(
        line.split(" [")[0] if line.startswith(":") else line
        for line in text.splitlines()
        if not line.startswith("#")
    )


def _expected(before: str, applied: Plan) -> dict[str, list[str]]:
    """The table `before`, with the plan's chains and its jumps appended to the built-in chains."""
    table = parse_save(before)
    for chain in applied.chains:
        table[chain] = []
    for rule in (*applied.rules, *applied.jumps):
        table[rule.chain].append(rule.render())
    return table


def _restore(netns: Run, mode: str, text: str, tmp: Path) -> None:
    rules = tmp / "rules"
    rules.write_text(text)
    netns(f"iptables-{mode}-restore", "--noflush", str(rules))


def _with_unrelated(netns: Run, mode: str, tmp: Path) -> str:
    _restore(netns, mode, UNRELATED, tmp)
    return _saved(netns, mode)


@pytest.mark.netns
@pytest.mark.parametrize("settings", sorted(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_applier_writes_the_plan(netns: Run, mode: str, settings: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode, *SETTINGS[settings])
    assert parse_save(_saved(netns, mode)) == _expected(before, _plan(SETTINGS[settings]))


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_applying_twice_leaves_one_copy(netns: Run, mode: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode, *SETTINGS["local-mesh"])
    second = netns(INIT, "--mode", mode, *SETTINGS["local-mesh"]).stdout
    assert "-F PROXY_INIT_OUTPUT" in second and "-N " not in second  # flushed, not created
    assert "-j PROXY_INIT_OUTPUT" not in second  # the jumps are there already
    assert parse_save(_saved(netns, mode)) == _expected(before, _plan(SETTINGS["local-mesh"]))


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_other_settings_replace_the_rules(netns: Run, mode: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode, *SETTINGS["everything"])
    netns(INIT, "--mode", mode, *SETTINGS["local-mesh"])
    assert parse_save(_saved(netns, mode)) == _expected(before, _plan(SETTINGS["local-mesh"]))


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_jump_is_reduced_to_one(netns: Run, mode: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode)
    jump = _plan([]).jumps[1].render()
    _restore(netns, mode, f"*nat\n{jump}\nCOMMIT\n", tmp_path)
    netns(INIT, "--mode", mode)
    assert parse_save(_saved(netns, mode)) == _expected(before, _plan([]))


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_cleanup_restores_the_table_as_it_was(netns: Run, mode: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode, *SETTINGS["everything"])
    assert _saved(netns, mode) != before
    result = netns(INIT, "cleanup", "--mode", mode)
    assert "6 changes" in result.stdout
    assert _saved(netns, mode) == before
    again = netns(INIT, "cleanup", "--mode", mode)  # nothing left to remove
    assert "0 changes" in again.stdout
    assert _saved(netns, mode) == before


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_cleanup_keeps_rules_added_after_ours(netns: Run, mode: str, tmp_path: Path) -> None:
    """Our jump is deleted by its position as read: a rule appended after it stays."""
    _with_unrelated(netns, mode, tmp_path)
    netns(INIT, "--mode", mode)
    later = "-A OUTPUT -d 203.0.113.9/32 -p tcp -j RETURN"
    _restore(netns, mode, f"*nat\n{later}\nCOMMIT\n", tmp_path)
    with_later = _saved(netns, mode)
    netns(INIT, "cleanup", "--mode", mode)
    expected = parse_save(with_later)
    del expected["PROXY_INIT_OUTPUT"], expected["PROXY_INIT_REDIRECT"]
    expected["PREROUTING"] = [r for r in expected["PREROUTING"] if "PROXY_INIT" not in r]
    expected["OUTPUT"] = [r for r in expected["OUTPUT"] if "PROXY_INIT" not in r]
    assert expected["OUTPUT"][-1] == later
    assert parse_save(_saved(netns, mode)) == expected


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_bad_values_change_nothing(netns: Run, mode: str, tmp_path: Path) -> None:
    before = _with_unrelated(netns, mode, tmp_path)
    result = netns(
        "env",
        "MESHLET_INIT_PROXY_GID=staff",
        f"MESHLET_INIT_MODE={mode}",
        INIT,
        "--inbound-ports-to-ignore",
        "70000",
        "--subnets-to-ignore",
        "10.0.0.0/33",
        "--outgoing-proxy-port",
        "0",
        check=False,
    )
    assert result.returncode == 64, result
    assert result.stdout == ""
    problems = result.stderr.splitlines()
    assert problems[0] == "meshlet-init: bad configuration, nothing was changed:"
    assert [p.split()[0] for p in problems[1:]] == [
        "--outgoing-proxy-port",
        "--proxy-gid",
        "--inbound-ports-to-ignore",
        "--subnets-to-ignore",
    ]
    assert "(MESHLET_INIT_PROXY_GID): 'staff' is not a numeric ID" in result.stderr
    assert _saved(netns, mode) == before
    assert "PROXY_INIT" not in _saved(netns, "legacy") + _saved(netns, "nft")


@pytest.mark.netns
def test_flags_win_over_the_environment(netns: Run) -> None:
    netns("env", "MESHLET_INIT_PROXY_GID=7", "MESHLET_INIT_OUTGOING_PROXY_PORT=15001",
          INIT, "--proxy-gid", "2102")  # fmt: skip
    saved = _saved(netns, "legacy")
    assert "--gid-owner 2102" in saved and "--gid-owner 7" not in saved
    assert "REDIRECT --to-ports 15001" in saved


def test_help_lists_every_flag_with_its_environment_variable() -> None:
    from meshlet.init.config import FLAGS

    result = subprocess.run(
        [INIT, "--help"], capture_output=True, text=True, env={"COLUMNS": "100"}, check=True
    )
    blocks: dict[str, str] = {}  # option → its help, unwrapped
    option = ""
    for line in result.stdout.splitlines():
        if line.startswith("  --"):
            option = line.split()[0]
        elif not line.startswith("    "):
            option = ""
        if option:
            blocks[option] = f"{blocks.get(option, '')} {line.strip()}"
    assert sorted(blocks) == sorted(flag.option for flag in FLAGS)
    for flag in FLAGS:
        text = " ".join(blocks[flag.option].split())
        assert " ".join(flag.help.split()) in text
        assert f"[env {flag.env}; default: {flag.default or 'none'}]" in text
    assert "{apply,cleanup,check}" in result.stdout
    assert "77  refused: this is the machine's own network namespace" in result.stdout
    assert "64  bad flags or environment" in result.stdout
