"""`meshlet`: install, check and operate the mesh."""

from __future__ import annotations

import sys

import click

from meshlet.cli.authz import authz
from meshlet.cli.check import check
from meshlet.cli.completion import completion
from meshlet.cli.demo.command import demo
from meshlet.cli.diagnostics import diagnostics
from meshlet.cli.identity import identity
from meshlet.cli.inject import inject, uninject
from meshlet.cli.install import install
from meshlet.cli.installcni import install_cni
from meshlet.cli.prune import prune
from meshlet.cli.stat import stat
from meshlet.cli.uninstall import uninstall
from meshlet.cli.upgrade import upgrade
from meshlet.cli.version import version
from meshlet.cli.viz import viz
from meshlet.cli.viztap import tap
from meshlet.cli.viztop import top

EX_CONFIG = 64
# What `pip install meshlet` leaves out and `pip install 'meshlet[cli]'` adds: verbs that need
# them say so in one line (the rest of the CLI works without them).
CLI_EXTRA = frozenset({"rich", "jsonpatch", "helm_python"})


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="meshlet", prog_name="meshlet")
def cli() -> None:
    """meshlet: a small, fast, security-first service mesh for Kubernetes."""


cli.add_command(identity)
cli.add_command(demo)
cli.add_command(install)
cli.add_command(install_cni)
cli.add_command(inject)
cli.add_command(uninject)
cli.add_command(check)
cli.add_command(stat)
viz.add_command(tap)
viz.add_command(top)
cli.add_command(viz)
cli.add_command(authz)
cli.add_command(diagnostics)
cli.add_command(uninstall)
cli.add_command(upgrade)
cli.add_command(prune)
cli.add_command(version)
cli.add_command(completion)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="meshlet", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        sys.exit(EX_CONFIG)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in CLI_EXTRA:
            raise
        click.echo(f"Error: this command needs the cli extra (it lacks {exc.name}): pip install"
                   " 'meshlet[cli]'", err=True)  # fmt: skip
        sys.exit(1)


if __name__ == "__main__":
    main()
