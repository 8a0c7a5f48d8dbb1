"""A local mesh kept running (`meshlet demo --keep`) as other commands find it, and the one rule
for which namespace a command reads when `-n` is not given.

A command reads the kept local mesh when it has nowhere else to go (when several run: the one
$MESHLET_DEMO names, else the default one, demo): `viz stat|edges|routes`
without `--prometheus-url`; `viz tap|top|dashboard` and `authz` without an address of their own
and with no cluster named (no `--kubeconfig` or `--context`, no `$KUBECONFIG`, no
`~/.kube/config`). Its namespace then is the local mesh's (`demo`); otherwise, as kubectl and
`linkerd viz` do, the namespace of the kubeconfig's context, else `default`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshlet.cli.demo.topology import (
    DEFAULT_NAME,
    DEFAULT_PLACE,
    NAMESPACE,
    Layout,
    Mode,
    Place,
    layout,
)

NAME_ENV = "MESHLET_DEMO"  # names the local mesh commands read when several run

DEFAULT_NAMESPACE = "default"
NAMESPACE_HELP = (
    "Default: the local mesh's (demo) when a kept `meshlet demo --keep` is read, else the "
    "kubeconfig context's, else default."
)


@dataclass(frozen=True, slots=True)
class Kept:
    """A local mesh that runs: its mode (netns, loopback), its state folder, and what a user
    can reach (`prometheus`, `dashboard`, `tap`: URLs)."""

    mode: str
    root: Path
    urls: dict[str, str]
    namespace: str = NAMESPACE
    place: Place = DEFAULT_PLACE

    @property
    def layout(self) -> Layout:
        return layout(Mode(self.mode), self.place)

    @property
    def manifests(self) -> Path:
        """The folder its controllers read: its Pods, Services and policy resources."""
        return self.root / "manifests"


def kept() -> Kept | None:
    """The local mesh kept running on this machine that a command reads, if any: the one
    $MESHLET_DEMO names; else the default one (demo) when it runs, else the only one that
    runs (UsageError when several others run and none is named)."""
    from meshlet.cli.demo.supervisor import records

    found = [r for r in records() if r.processes]
    wanted = os.environ.get(NAME_ENV)
    if wanted:
        found = [r for r in found if r.name == wanted]
    elif len(found) > 1:
        default = [r for r in found if r.name == DEFAULT_NAME]
        if not default:
            import click

            names = ", ".join(r.name for r in found)
            raise click.UsageError(
                f"local meshes {names} run: name the one to read with {NAME_ENV}=<name>"
            )
        found = default
    if not found:
        return None
    record = found[0]
    return Kept(record.mode, Path(record.root), dict(record.urls),
                place=Place(record.name, record.slot))  # fmt: skip


def cluster_named(kubeconfig: Path | None = None, context: str | None = None) -> bool:
    """Whether a cluster is named: a kubeconfig or context given, $KUBECONFIG, ~/.kube/config."""
    return (
        bool(kubeconfig or context or os.environ.get("KUBECONFIG"))
        or Path("~/.kube/config").expanduser().exists()
    )


def namespace(
    given: str | None,
    local: Kept | None,
    kubeconfig: Path | None = None,
    context: str | None = None,
) -> str:
    """`-n` when given; else the local mesh's namespace when the command reads it (`local`);
    else the kubeconfig context's, else `default`."""
    if given:
        return given
    if local is not None:
        return local.namespace
    try:
        from meshlet.cli.cluster import default_namespace
    except ImportError:  # without the `cli` extra there is no kubeconfig to read
        return DEFAULT_NAMESPACE
    given_file = kubeconfig or os.environ.get("KUBECONFIG")  # as read now, not at import
    try:
        return default_namespace(Path(given_file) if given_file else None, context)
    except ImportError:
        return DEFAULT_NAMESPACE
