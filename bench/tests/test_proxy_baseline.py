"""A previous revision checked out for one run: in a real git repository whose proxy is a stub
that prints its settings table, as `meshlet-proxy --help` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.proxy_baseline import (
    BaselineError,
    check,
    checked_out,
    compile_sources,
    order,
    settings_in_help,
    source_roots,
)

OLD, NEW = "MESHLET_PROXY_LOG", "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD"


def _stub_proxy(settings: list[str]) -> str:
    table = "".join(f"  {name} [x]\\n" for name in settings)
    return f'import sys\nif sys.argv[1:] == ["--help"]:\n    sys.stdout.write("usage\\n{table}")\n'


def _git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
    done = subprocess.run(
        ["git", "-C", str(repo), *identity, *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _commit(repo: Path, settings: list[str]) -> str:
    proxy = repo / "proxy" / "meshlet" / "proxy"
    proxy.mkdir(parents=True, exist_ok=True)
    (proxy / "__init__.py").touch()
    (proxy / "main.py").write_text(_stub_proxy(settings))
    api = repo / "proto" / "meshlet" / "api"
    api.mkdir(parents=True, exist_ok=True)
    (api / "__init__.py").touch()
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"a proxy reading {', '.join(settings)}")
    return _git(repo, "rev-parse", "--short", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two revisions: the first proxy reads OLD only, the second OLD and NEW."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _commit(repo, [OLD])
    _commit(repo, [OLD, NEW])
    return repo


def _worktrees(repo: Path) -> list[str]:
    return [
        line.removeprefix("worktree ")
        for line in _git(repo, "worktree", "list", "--porcelain").splitlines()
        if line.startswith("worktree ")
    ]


def test_the_revision_is_checked_out_for_the_block_and_removed_after(repo: Path) -> None:
    first = _git(repo, "rev-parse", "--short", "HEAD~1")
    with checked_out(repo, "HEAD~1") as baseline:
        assert baseline.name == f"meshlet@{first}"
        assert baseline.subject == f"a proxy reading {OLD}"
        assert NEW not in (baseline.path / "proxy/meshlet/proxy/main.py").read_text()
        assert str(baseline.path) in _worktrees(repo)
        command = f"env PYTHONPATH={baseline.path}/proto:{baseline.path}/proxy {{python}} -m "
        assert baseline.command == command + "meshlet.proxy.main"
    assert not baseline.path.exists()
    assert baseline.command == command + "meshlet.proxy.main"  # as the report says it ran
    assert _worktrees(repo) == [str(repo)]


def test_a_failed_run_removes_the_checkout_too(repo: Path) -> None:
    with pytest.raises(KeyboardInterrupt), checked_out(repo, "HEAD") as baseline:
        raise KeyboardInterrupt
    assert not baseline.path.exists()
    assert _worktrees(repo) == [str(repo)]


def test_an_unknown_revision_is_named(repo: Path) -> None:
    with (
        pytest.raises(BaselineError, match="--baseline nosuch: no such commit in"),
        checked_out(repo, "nosuch"),
    ):
        pass
    assert _worktrees(repo) == [str(repo)]


def test_a_revision_reading_every_setting_passes(repo: Path) -> None:
    with checked_out(repo, "HEAD") as baseline:
        check(baseline, [OLD, NEW])  # imports from the checkout, its --help lists both


def test_a_revision_without_a_setting_the_bench_writes_is_refused(repo: Path) -> None:
    with checked_out(repo, "HEAD~1") as baseline:
        with pytest.raises(BaselineError) as refused:
            check(baseline, [OLD, NEW])
        assert f"{baseline.name} does not read {NEW}, which the bench sets" in str(refused.value)


def test_a_revision_whose_help_lists_no_settings_is_refused(repo: Path) -> None:
    _commit(repo, [])
    with checked_out(repo, "HEAD") as baseline, pytest.raises(BaselineError) as refused:
        check(baseline, [OLD])
    assert "`meshlet-proxy --help` lists no MESHLET_PROXY_* settings" in str(refused.value)


def test_bytecode_is_compiled_ahead_only_where_python_writes_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proxy" / "meshlet").mkdir(parents=True)
    (tmp_path / "proxy" / "meshlet" / "m.py").write_text("x = 1\n")
    (tmp_path / "testing").mkdir()
    roots = source_roots(tmp_path)
    assert roots == (tmp_path / "proxy",)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE
    compile_sources(roots)
    assert not list(tmp_path.rglob("*.pyc"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    compile_sources(roots)
    assert [p.name.partition(".")[0] for p in tmp_path.rglob("*.pyc")] == ["m"]


def test_the_settings_table_of_help() -> None:
    text = "usage: meshlet-proxy\n\nsettings (environment, default):\n"
    text += f"  {OLD} [info]\n  {NEW} [120s]\n  not a setting [x]\n"
    assert settings_in_help(text) == {OLD, NEW}
    assert settings_in_help("usage: meshlet-proxy\n") == frozenset()


def test_the_baseline_goes_before_and_after_meshlet_in_turn() -> None:
    proxies = ["direct", "meshlet", "envoy", "meshlet-mesh", "envoy-mesh"]
    then = "meshlet@abc1234"
    assert order(proxies, then, 0) == [
        "direct", then, "meshlet", "envoy", "meshlet-mesh", f"{then}-mesh", "envoy-mesh",
    ]  # fmt: skip
    assert order(proxies, then, 1) == [
        "direct", "meshlet", then, "envoy", f"{then}-mesh", "meshlet-mesh", "envoy-mesh",
    ]  # fmt: skip
    assert order(["direct", "meshlet-mesh"], then, 0) == ["direct", "meshlet-mesh", f"{then}-mesh"]
