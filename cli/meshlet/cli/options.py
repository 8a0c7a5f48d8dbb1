"""The options every verb that reaches a cluster shares, spelt one way: `--kubeconfig`,
`--context`, and the control plane's namespace as `-L/--control-plane-namespace` (Linkerd's
`-L/--linkerd-namespace`, with `$MESHLET_NAMESPACE` as Linkerd's `$LINKERD_NAMESPACE`), so that
`-n/--namespace` always means a workload's namespace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import click

from meshlet.api import wellknown as wk

F = TypeVar("F", bound=Callable[..., Any])

NAMESPACE_ENV: Final = "MESHLET_NAMESPACE"
KUBECONFIG_HELP: Final = "The kubeconfig file. Default: $KUBECONFIG, else ~/.kube/config."
CONTEXT_HELP: Final = "The kubeconfig context. Default: its current context."
CONTROL_PLANE_HELP: Final = f"The control plane's namespace (${NAMESPACE_ENV})."
_OLD_FLAG: Final = "control_plane_namespace_as_namespace"


def cluster(command: F) -> F:
    """--kubeconfig and --context."""
    command = click.option("--context", help=CONTEXT_HELP)(command)
    return click.option(
        "--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), help=KUBECONFIG_HELP
    )(command)


def control_plane_namespace(
    *, was_namespace: bool = False, help: str = CONTROL_PLANE_HELP
) -> Callable[[F], F]:
    """-L/--control-plane-namespace, the parameter `control_plane_namespace`. `was_namespace`:
    the verb called it --namespace before; that spelling still works, hidden, with a note."""

    def from_old_spelling(ctx: click.Context, param: click.Parameter, value: str) -> str:
        old = ctx.meta.get(_OLD_FLAG)
        if old is None:
            return value
        if ctx.get_parameter_source(param.name or "") is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError("give the control plane's namespace once: -L (not --namespace)")
        return str(old)

    def old_spelling(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value is not None:
            click.echo(f"note: --namespace is -L/--control-plane-namespace now (-n is always a"
                       f" workload's namespace); using {value}", err=True)  # fmt: skip
            ctx.meta[_OLD_FLAG] = value

    def decorate(command: F) -> F:
        if was_namespace:
            command = click.option("--namespace", hidden=True, expose_value=False,
                                   is_eager=True, callback=old_spelling)(command)  # fmt: skip
        return click.option(
            "-L", "--control-plane-namespace", "control_plane_namespace",
            default=wk.CONTROL_PLANE_NAMESPACE, envvar=NAMESPACE_ENV, show_default=True,
            callback=from_old_spelling, help=help,
        )(command)  # fmt: skip

    return decorate


def chart_values(set_example: str) -> Callable[[F], F]:
    """--set (repeatable, as Helm's) and --values/-f: the parameters `sets` and `values_files`
    of a verb that renders a chart."""

    def decorate(command: F) -> F:
        command = click.option(
            "--values", "-f", "values_files", multiple=True,
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="A YAML file of chart values (repeatable; later files win; --set wins over"
            " files).",
        )(command)  # fmt: skip
        return click.option(
            "--set", "sets", multiple=True, metavar="KEY=VALUE",
            help=f"A chart value, as Helm's --set (repeatable): {set_example}.",
        )(command)  # fmt: skip

    return decorate
