"""One CLI: every verb spells the options it shares the same way, and every mistake a user can
make about which cluster gets a short hint, never a traceback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from meshlet.cli.main import cli
from meshlet.cli.options import NAMESPACE_ENV

Run = Callable[..., Any]


def leaves(command: click.Command, path: tuple[str, ...] = ("meshlet",)) -> Iterator[Any]:
    if isinstance(command, click.Group):
        if command.invoke_without_command:  # a verb of its own too (`meshlet demo`)
            yield " ".join(path), command
        for name, sub in sorted(command.commands.items()):
            yield from leaves(sub, (*path, name))
    else:
        yield " ".join(path), command


VERBS = dict(leaves(cli))


def visible(command: click.Command) -> dict[str, click.Option]:
    return {
        opt: param
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden
        for opt in (*param.opts, *param.secondary_opts)
    }


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_each_verb_spells_the_shared_options_one_way(verb: str) -> None:
    """--kubeconfig comes with --context; the control plane's namespace is always
    -L/--control-plane-namespace (from $MESHLET_NAMESPACE too); -n/--namespace is never the
    control plane's; every option says what it does."""
    options = visible(VERBS[verb])
    assert ("--kubeconfig" in options) == ("--context" in options), verb
    if "--control-plane-namespace" in options:
        param = options["--control-plane-namespace"]
        assert "-L" in param.opts and param.envvar == NAMESPACE_ENV, verb
    if "--namespace" in options:
        assert "-n" in options["--namespace"].opts, verb
        assert "control plane" not in (options["--namespace"].help or ""), verb
    for name, param in options.items():
        assert param.help, (verb, name)
    if "--kubeconfig" in options and not verb.startswith("meshlet demo"):
        assert "--control-plane-namespace" in options or verb in (
            "meshlet stat", "meshlet diagnostics proxy-metrics",
        ), verb  # fmt: skip


def test_the_control_plane_namespace_by_flag_environment_and_old_spelling(
    meshlet: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    def namespaces(out: str) -> set[str]:
        return {d["metadata"]["namespace"] for d in yaml.safe_load_all(out)
                if d and "namespace" in d["metadata"]}  # fmt: skip

    run = meshlet("uninstall", "-L", "mesh-a")
    assert run.code == 0 and namespaces(run.out) == {"mesh-a"}
    monkeypatch.setenv(NAMESPACE_ENV, "mesh-b")
    assert namespaces(meshlet("uninstall").out) == {"mesh-b"}
    run = meshlet("uninstall", "--namespace", "mesh-c")  # as the verb spelt it before
    assert run.code == 0 and namespaces(run.out) == {"mesh-c"}
    assert "--namespace is -L/--control-plane-namespace now" in run.err
    run = meshlet("uninstall", "--namespace", "mesh-c", "-L", "mesh-d")
    assert run.code == 64 and "give the control plane's namespace once" in run.err


def kubeconfig(path: Path, server: str = "http://127.0.0.1:9", current: str = "x") -> Path:
    path.write_text(
        f"apiVersion: v1\nkind: Config\ncurrent-context: '{current}'\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}},"
        " {name: y, context: {cluster: c, user: u}}]\n"
    )
    return path


VERBS_REACHING_A_CLUSTER = [("stat", "deploy"), ("upgrade",),
                            ("diagnostics", "proxy-metrics", "po/web-1"),
                            ("viz", "tap", "deploy/web")]  # fmt: skip


@pytest.mark.parametrize("verb", VERBS_REACHING_A_CLUSTER)
def test_each_cluster_mistake_gets_its_hint(
    meshlet: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verb: tuple[str, ...]
) -> None:
    """No kubeconfig at all, a --kubeconfig that does not exist, a --context the kubeconfig
    lacks, a kubeconfig without a current context, and an API server nothing answers at: each
    a one-line error saying what to do (exit 1)."""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    good = kubeconfig(tmp_path / "config")
    cases = [
        # (viz tap with no cluster named reads a kept local mesh instead, by design)
        *([((), "give --kubeconfig")] if verb[0] != "viz" else []),
        (("--kubeconfig", str(tmp_path / "nope")), f"kubeconfig {tmp_path}/nope not found"),
        (("--kubeconfig", str(good), "--context", "z"),
         f"context 'z' is not in {good}; its contexts: x, y"),
        (("--kubeconfig", str(kubeconfig(tmp_path / "none", current=""))),
         "has no current context: give --context (one of: x, y)"),
        (("--kubeconfig", str(good), "--context", "y"),
         "cannot reach the Kubernetes API (") ,
    ]  # fmt: skip
    for flags, hint in cases:
        run = meshlet(*verb, *flags)
        assert run.code == 1, (flags, run.err)
        assert hint in run.err, (flags, run.err)
        assert "Traceback" not in run.err and len(run.err.strip().splitlines()) == 1, run.err
    assert "kubectl cluster-info" in run.err


def cli_reference() -> str:
    """docs/cli.md: every verb with its options, from the commands themselves."""
    lines = [
        "# The meshlet CLI: every verb and its options",
        "",
        "Generated from the commands (`cli/tests/test_options.py`; `pytest --update-golden`",
        "rewrites it). The same spelling everywhere: `-n/--namespace` is a workload's namespace;",
        "the control plane's is `-L/--control-plane-namespace` (or `$MESHLET_NAMESPACE`, default",
        "`meshlet`; the verbs that called it `--namespace` before still take that spelling, with a",
        "note); every verb that reaches a cluster takes `--kubeconfig` and `--context`. A missing",
        "kubeconfig, a context it lacks, one without a current context and an API server that does",
        "not answer each end the command with one line saying what to do (exit 1); a usage",
        "mistake exits 64. `meshlet VERB --help` says more.",
        "",
        "| verb | options |",
        "| --- | --- |",
    ]
    for verb, command in sorted(VERBS.items()):
        options = []
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                options.append("/".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts)))
        arguments = " ".join(p.human_readable_name for p in command.params
                             if isinstance(p, click.Argument))  # fmt: skip
        name = f"`{verb}{' ' + arguments if arguments else ''}`".replace("|", "\\|")
        lines.append(f"| {name} | {', '.join(options) or '-'} |")
    return "\n".join(lines) + "\n"


def test_the_cli_reference_in_docs_is_the_commands(golden: Callable[[Path, str], None]) -> None:
    golden(Path(__file__).parents[2] / "docs" / "cli.md", cli_reference())
