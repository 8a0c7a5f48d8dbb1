"""A previous revision of meshlet's proxy, checked out to be measured in the same run as this one.

`python -m bench.proxy --baseline REV` runs meshlet's rows twice: with this tree's proxy and with
REV's, which `checked_out` puts in a temporary directory (`git worktree add --detach`) and
removes when the run ends, however it ends. REV's proxy runs from that checkout's sources on this
venv's packages (`env PYTHONPATH=<checkout>/cli:…:<checkout>/proxy python -m meshlet.proxy.main`);
its protobuf modules are committed, so nothing is generated, and its modules are compiled as
this tree's are (`compile_sources`), so both start alike. It gets the same MESHLET_PROXY_*
environment as this tree's proxy, so `check` asks REV's own `meshlet-proxy --help` which settings
it reads and refuses a revision that would not read every name the bench writes.

`order` places REV's rows beside meshlet's, first before them and then after, so that a machine
growing busier or quieter during the run does not favour one. Pure: `order`, `settings_in_help`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshlet.api import wellknown

MESHLET_ROWS: Final = ("meshlet", "meshlet-mesh")  # the rows measured again with the baseline
HELP_TIMEOUT: Final = 30.0
_SETTING: Final = re.compile(rf"^\s+({wellknown.PROXY_ENV_PREFIX}[A-Z0-9_]+) \[", re.MULTILINE)


class BaselineError(Exception):
    """Why the baseline cannot be measured, in words for whoever asked for it."""


@dataclass(frozen=True, slots=True)
class Baseline:
    """REV checked out: its name in the report and how to start its proxy."""

    commit: str
    short: str
    subject: str
    path: Path  # the checkout
    roots: tuple[Path, ...]  # its source roots: the folders holding a `meshlet` package

    @property
    def name(self) -> str:
        """The one-hop row's proxy name; the pair's is this with "-mesh"."""
        return f"meshlet@{self.short}"

    @property
    def pythonpath(self) -> str:
        return os.pathsep.join(map(str, self.roots))

    @property
    def command(self) -> str:
        """How the bench starts REV's proxy (`{python}`: this interpreter)."""
        return f"env PYTHONPATH={shlex.quote(self.pythonpath)} {{python}} -m meshlet.proxy.main"


def resolve(repo: Path, rev: str) -> tuple[str, str, str]:
    """`rev`'s commit in `repo`: the full hash, git's abbreviation and the subject."""
    found = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if found.returncode:
        raise BaselineError(
            f"--baseline {rev}: no such commit in {repo}; give a commit, tag or branch of this "
            "repository (e.g. --baseline main or --baseline HEAD~1)"
        )
    commit = found.stdout.strip()
    described = _git(repo, "log", "-1", "--format=%h%x00%s", commit).stdout.strip()
    short, _, subject = described.partition("\0")
    return commit, short, subject


@contextlib.contextmanager
def checked_out(repo: Path, rev: str) -> Iterator[Baseline]:
    """`rev` of `repo` in a fresh temporary worktree (its modules compiled as `compile_sources`
    says) for the `with` block; removed afterwards, also when the block fails or is
    interrupted."""
    commit, short, subject = resolve(repo, rev)
    path = Path(tempfile.mkdtemp(prefix=f"meshlet-bench-{short}-"))
    try:
        _git(repo, "worktree", "add", "--detach", "--quiet", str(path), commit)
        roots = source_roots(path)
        compile_sources(roots)
        yield Baseline(commit, short, subject, path, roots)
    finally:
        _remove(repo, path)


def source_roots(tree: Path) -> tuple[Path, ...]:
    """The folders of `tree` holding a `meshlet` package (proxy, proto, ...)."""
    return tuple(sorted(p.parent for p in tree.glob("*/meshlet")))


def compile_sources(roots: Iterable[Path]) -> None:
    """Bytecode for every module under `roots`, so that no proxy compiles its modules when it
    starts (which leaves the compiler's memory in its RSS), unless Python is told to write none
    (PYTHONDONTWRITEBYTECODE): then no tree gets any, and every proxy compiles alike. Both trees
    go through here, so that the two revisions start the same way."""
    if not sys.dont_write_bytecode:
        subprocess.run([sys.executable, "-m", "compileall", "-q", *map(str, roots)], check=True)


def _remove(repo: Path, path: Path) -> None:
    """The worktree at `path` gone from the disk and from `repo`'s list of worktrees."""
    removed = _git(repo, "worktree", "remove", "--force", str(path), check=False)
    if removed.returncode:  # never added, or half: drop the directory, then git's record of it
        shutil.rmtree(path, ignore_errors=True)
        _git(repo, "worktree", "prune", check=False)


def check(baseline: Baseline, written: Iterable[str]) -> None:
    """BaselineError unless REV's proxy imports from the checkout and reads every setting in
    `written` (the MESHLET_PROXY_* names the bench sets)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(wellknown.PROXY_ENV_PREFIX)}
    source = ["env", f"PYTHONPATH={baseline.pythonpath}", sys.executable]
    where = "import meshlet.api, meshlet.proxy.main as m; print(m.__file__)"
    imported = _run(baseline, [*source, "-c", where], env)
    if not Path(imported.strip()).is_relative_to(baseline.path):
        raise BaselineError(
            f"{baseline.name}: `{baseline.command}` imported meshlet.proxy from {imported.strip()}"
            f", not from the checkout {baseline.path}"
        )
    argv = shlex.split(baseline.command.replace("{python}", sys.executable))
    settings = settings_in_help(_run(baseline, [*argv, "--help"], env))
    if not settings:
        raise BaselineError(
            f"{baseline.name}: its `meshlet-proxy --help` lists no MESHLET_PROXY_* settings, so "
            "the bench cannot tell whether it reads the ones it writes; --baseline takes a "
            "revision whose proxy lists them (docs/bench.md says which)"
        )
    if unread := sorted(set(written) - settings):
        raise BaselineError(
            f"{baseline.name} does not read {', '.join(unread)}, which the bench sets for every "
            "meshlet proxy (it would refuse them as unknown, or run without them): --baseline "
            "takes a revision whose proxy reads the same MESHLET_PROXY_* names as this one "
            "(docs/bench.md says which)"
        )


def settings_in_help(text: str) -> frozenset[str]:
    """The MESHLET_PROXY_* names `meshlet-proxy --help` lists, one a line: `  NAME [default]`."""
    return frozenset(_SETTING.findall(text))


def order(proxies: Sequence[str], baseline: str, turn: int) -> list[str]:
    """`proxies` with the baseline's row beside each of meshlet's (`baseline`, `baseline`-mesh):
    before it on even turns (turn: the scenario's index) and after it on odd ones, the meshed
    pair the other way round from the one hop, so each order is measured as often."""
    ordered: list[str] = []
    for proxy in proxies:
        if proxy not in MESHLET_ROWS:
            ordered.append(proxy)
            continue
        pair = proxy.endswith("-mesh")
        theirs = baseline + "-mesh" if pair else baseline
        ordered += [theirs, proxy] if (turn + pair) % 2 == 0 else [proxy, theirs]
    return ordered


def _run(baseline: Baseline, argv: list[str], env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=HELP_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise BaselineError(
            f"{baseline.name}: `{shlex.join(argv)}` did not finish within {HELP_TIMEOUT:g} s"
        ) from None
    if done.returncode:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise BaselineError(
            f"{baseline.name}: `{shlex.join(argv)}` failed: {said[0]} (if a module is missing, "
            f"its proxy needs packages this venv lacks: compare its pyproject.toml)"
        )
    return done.stdout


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and done.returncode:
        raise BaselineError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done
