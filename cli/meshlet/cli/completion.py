"""`meshlet completion SHELL`: the shell completion script (click's own)."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL.

    \b
    source <(meshlet completion bash)
    """
    root = ctx.find_root()
    cls = get_completion_class(shell)
    assert cls is not None
    script = cls(root.command, {}, "meshlet", "_MESHLET_COMPLETE").source()
    click.echo(script)
