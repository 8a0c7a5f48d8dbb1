"""Running the `meshlet` command in-process, as a user would from a shell; a meshed namespace
in the fake API server with proxies behind its pods, for the commands that read them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlet.cli.main import main
from meshlet_testing.background import BackgroundLoop
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.meshed import Emojivoto, Proxies


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


@pytest.fixture(autouse=True)
def no_kubeconfig_of_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands reach only the clusters a test names, never the one a developer's
    `$KUBECONFIG` points at, and read no local mesh a developer's `$MESHLET_DEMO` names."""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("MESHLET_DEMO", raising=False)


@pytest.fixture
def meshlet(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*args: str) -> Run:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def unreachable_kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig whose API server address nothing listens on."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    return kubeconfig


@pytest.fixture
def background() -> Iterator[BackgroundLoop]:
    with BackgroundLoop() as loop:
        yield loop


@pytest.fixture
def emojivoto(
    api: FakeKubeAPI, meshlet: Callable[..., Run], tmp_path: Path, background: BackgroundLoop
) -> Iterator[Emojivoto]:
    """Namespace emojivoto of `meshlet_testing.meshed`, built with this `meshlet`."""
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
    world = Emojivoto(api, meshlet, kubeconfig, Proxies(api, background))
    try:
        world.build()
        yield world
    finally:
        world.proxies.close()
