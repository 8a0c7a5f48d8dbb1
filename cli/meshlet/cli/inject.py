"""`meshlet inject`: mesh the workloads of a YAML stream. Documents without a pod template are
written back byte for byte."""

from __future__ import annotations

import datetime as dt
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import click
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli import injecting, options
from meshlet.cli.injecting import Result, annotate, injectable
from meshlet.cli.manifests import dump
from meshlet.controlplane.injector.config import InjectConfig

_SEPARATOR: Final = re.compile(r"(?m)^---(?=[ \t]|$)[^\n]*\n?")


def split(text: str) -> list[tuple[str, str]]:
    """(separator, document text) pairs that join back into `text` exactly."""
    parts: list[tuple[str, str]] = []
    start, separator = 0, ""
    for match in _SEPARATOR.finditer(text):
        parts.append((separator, text[start : match.start()]))
        separator, start = match.group(0), match.end()
    parts.append((separator, text[start:]))
    return parts


One = Callable[[dict[str, Any]], Result]


def _transform(doc: Any, one: One) -> tuple[Any, bool, list[str]]:
    if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
        items, changed, notes = [], False, []
        for item in doc["items"]:
            new, did, item_notes = _transform(item, one)
            items.append(new)
            changed |= did
            notes += item_notes
        return ({**doc, "items": items} if changed else doc), changed, notes
    if not injectable(doc):
        return doc, False, []
    result = one(doc)
    return result.doc, result.changed, [result.note]


def inject_text(text: str, one: One) -> tuple[str, list[str]]:
    """The stream with each workload passed through `one`; other documents untouched."""
    out: list[str] = []
    notes: list[str] = []
    for separator, chunk in split(text):
        try:
            doc = yaml.safe_load(chunk)
        except yaml.YAMLError as exc:
            raise click.UsageError(f"not YAML: {exc}") from None
        new, changed, doc_notes = _transform(doc, one)
        notes += doc_notes
        out.append(separator + (dump(new) if changed else chunk))
    return "".join(out), notes


def offline_config(
    anchors: Path, values_files: tuple[Path, ...], sets: tuple[str, ...], namespace: str
) -> InjectConfig:
    """The proxy defaults the chart renders for these values, without a cluster."""
    from meshlet.cli import charts
    from meshlet.cli.install import generated, merge, user_values
    from meshlet.controlplane.injector.config import ConfigError, load

    values = user_values(values_files, sets)
    # Rendering needs every certificate; only the proxy defaults are read back.
    values = merge(values, generated(values, namespace, dt.datetime.now(dt.UTC), quiet=True))
    values = merge(values, {"identityTrustAnchorsPEM": anchors.read_text()})
    try:
        manifests = charts.render(charts.CONTROL_PLANE, values, namespace)
    except charts.ChartError as exc:
        raise click.UsageError(str(exc)) from None
    config_map = next(
        m.doc for m in manifests if m.doc["kind"] == "ConfigMap"
        and m.doc["metadata"]["name"] == wk.CONFIG_CONFIGMAP
    )  # fmt: skip
    try:
        return load(config_map["data"][wk.CONFIG_KEY], anchors.read_text())
    except ConfigError as exc:
        raise click.UsageError("; ".join(exc.problems)) from None


def cluster_config(kubeconfig: Path | None, context: str | None, namespace: str) -> InjectConfig:
    from meshlet.cli.cluster import ClusterError, api_client, read_config_map
    from meshlet.controlplane.injector.config import ConfigError, load

    client = api_client(kubeconfig, context)
    values = read_config_map(client, namespace, wk.CONFIG_CONFIGMAP).get(wk.CONFIG_KEY, "")
    roots = read_config_map(client, namespace, wk.TRUST_ROOTS_CONFIGMAP)
    try:
        return load(values, roots.get(wk.TRUST_ROOTS_KEY, ""))
    except ConfigError as exc:
        raise ClusterError("the cluster's meshlet-config: " + "; ".join(exc.problems)) from None


@click.command()
@click.argument("source", type=click.File("r", encoding="utf-8"))
@click.option(
    "--manual",
    is_flag=True,
    help="Add the proxy and init containers themselves instead of the annotation.",
)
@click.option(
    "--ignore-cluster",
    is_flag=True,
    help="With --manual: take the proxy defaults from the chart, not from the cluster.",
)
@click.option(
    "--identity-trust-anchors-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --ignore-cluster: the trust anchors the proxies verify peers with.",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="With --ignore-cluster.")
@click.option(
    "--values",
    "-f",
    "values_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --ignore-cluster: chart values files.",
)
@options.cluster
@options.control_plane_namespace(was_namespace=True)
def inject(
    source: Any,
    manual: bool,
    ignore_cluster: bool,
    identity_trust_anchors_file: Path | None,
    sets: tuple[str, ...],
    values_files: tuple[Path, ...],
    kubeconfig: Path | None,
    context: str | None,
    control_plane_namespace: str,
) -> None:
    """Mesh the workloads in SOURCE (a file, or - for standard input) and print the result.

    \b
    meshlet inject deploy.yaml | kubectl apply -f -
    kubectl get deploy -n emojivoto -o yaml | meshlet inject - | kubectl apply -f -
    meshlet inject --manual --ignore-cluster --identity-trust-anchors-file ca.pem deploy.yaml

    Multi-document streams and Lists are read; objects without a pod template are written back
    unchanged. A summary goes to standard error.
    """
    offline_flags = identity_trust_anchors_file is not None or sets or values_files
    if not manual and (ignore_cluster or offline_flags):
        raise click.UsageError("--ignore-cluster, --identity-trust-anchors-file, --set and"
                               " --values only apply with --manual")  # fmt: skip
    if manual and offline_flags and not ignore_cluster:
        raise click.UsageError("--identity-trust-anchors-file, --set and --values need"
                               " --ignore-cluster")  # fmt: skip
    text = source.read()
    one: One = annotate
    if manual:
        if ignore_cluster:
            if identity_trust_anchors_file is None:
                raise click.UsageError("--ignore-cluster needs --identity-trust-anchors-file")
            config = offline_config(
                identity_trust_anchors_file, values_files, sets, control_plane_namespace
            )
        else:
            config = cluster_config(kubeconfig, context, control_plane_namespace)
        one = functools.partial(injecting.manual, config=config)
    out, notes = inject_text(text, one)
    sys.stdout.write(out)
    for note in notes:
        click.echo(note, err=True)


@click.command()
@click.argument("source", type=click.File("r", encoding="utf-8"))
def uninject(source: Any) -> None:
    """Take the mesh out of the workloads in SOURCE (a file, or - for standard input) and print
    the result: the proxy and init containers, their volumes, the injector's labels and
    annotations and the inject annotation go; the rest stays as it was.

    \b
    kubectl get deploy -n emojivoto -o yaml | meshlet uninject - | kubectl apply -f -

    A namespace annotated for injection still meshes new pods: remove its annotation too.
    """
    out, notes = inject_text(source.read(), injecting.uninject)
    sys.stdout.write(out)
    for note in notes:
        click.echo(note, err=True)
