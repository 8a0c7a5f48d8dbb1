"""Owns the manifests-directory source: the watched kinds read from YAML files, re-read on change.

The local mesh has no API server; destination reads the same objects from `*.yaml`, `*.yml` and
`*.json` files instead. Parsing a file, grouping objects by kind and deciding which kinds changed
are plain functions; `ManifestsSource` only stats, reads and polls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from meshlet.controlplane.k8s.events import DESTINATION_KINDS, Kind, Object, Sink, Snapshot

logger = logging.getLogger(__name__)

SUFFIXES = frozenset({".yaml", ".yml", ".json"})
DEFAULT_NAMESPACE = "default"

Stamps = dict[Path, tuple[int, int]]  # file -> (mtime_ns, size)
ByKind = dict[Kind, tuple[Object, ...]]


class _Loader(yaml.SafeLoader):
    """YAML as the API server reads it: timestamps stay strings, as they are in JSON."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


class ManifestError(Exception):
    """A manifest file that cannot be read or parsed; the message names the file."""


# -- decisions -------------------------------------------------------------------------------


def parse_manifest(text: str, *, is_json: bool = False) -> list[Object]:
    """Every object of a file: YAML documents (`---`), `kind: List` items flattened.

    Objects come out as plain JSON (string keys, strings for anything JSON has no type for).
    Raises yaml.YAMLError or ValueError for text that does not parse or a document that is not
    an object."""
    if is_json:
        documents = [json.loads(text)]  # plain JSON already
    else:
        documents = json.loads(json.dumps(list(yaml.load_all(text, Loader=_Loader)), default=str))
    objects: list[Object] = []
    for index, doc in enumerate(documents):
        if doc is None:  # an empty document, e.g. a trailing `---`
            continue
        if not isinstance(doc, dict):
            raise ValueError(f"document {index + 1} is a {type(doc).__name__}, not an object")
        if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            items = doc["items"]
            if not all(isinstance(item, dict) for item in items):
                raise ValueError(
                    f"document {index + 1} is a List with an item that is not an object"
                )
            objects.extend(items)
        else:
            objects.append(doc)
    return objects


def group_by_kind(objects: Iterable[Object], kinds: tuple[Kind, ...] = DESTINATION_KINDS) -> ByKind:
    """The objects of the watched `kinds`, per kind (every kind present), in their given order.

    Objects without `metadata.namespace` get `default`, as `kubectl apply` would give them
    (cluster-scoped Namespaces excepted)."""
    grouped: dict[Kind, list[Object]] = {kind: [] for kind in kinds}
    for obj in objects:
        kind = Kind.of(str(obj.get("apiVersion")), str(obj.get("kind")))
        if kind is None or kind not in grouped:
            logger.debug("ignored %s %s", obj.get("apiVersion"), obj.get("kind"))
            continue
        metadata = obj.get("metadata")
        metadata = dict(metadata) if isinstance(metadata, dict) else {}
        if kind is not Kind.NAMESPACE:
            metadata.setdefault("namespace", DEFAULT_NAMESPACE)
        grouped[kind].append({**obj, "metadata": metadata})
    return {kind: tuple(objs) for kind, objs in grouped.items()}


def changed_kinds(before: Mapping[Kind, tuple[Object, ...]], after: ByKind) -> list[Kind]:
    """The kinds whose set of objects differs (order does not count), in `after`'s order."""
    return [kind for kind in after if _canonical(before.get(kind, ())) != _canonical(after[kind])]


def _canonical(objects: Iterable[Object]) -> list[str]:
    return sorted(json.dumps(obj, sort_keys=True) for obj in objects)


# -- the shell -------------------------------------------------------------------------------


def scan(directory: Path) -> Stamps:
    """(mtime_ns, size) of every manifest file under `directory`, skipping hidden entries
    (which also skips the `..data` links of a mounted ConfigMap, listed once by their names)."""
    stamps: Stamps = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.suffix not in SUFFIXES or any(p.startswith(".") for p in relative.parts):
            continue
        try:
            if not path.is_file():
                continue
            stat = path.stat()
        except OSError:  # removed while scanning: the next scan sees it gone
            continue
        stamps[path] = (stat.st_mtime_ns, stat.st_size)
    return stamps


def read_manifest(path: Path) -> tuple[Object, ...]:
    """The objects of one file; ManifestError says which file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
        return tuple(parse_manifest(text, is_json=path.suffix == ".json"))
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: {_yaml_fault(exc)}") from exc
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: {exc}") from exc


class ManifestsFolder:
    """Writes the folder a `ManifestsSource` reads: one file per group of objects, replaced in
    one step (a temporary dot file renamed over it), so a reader never sees half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, name: str, *objects: Object) -> Path:
        """Writes `objects` as `<root>/<name>.yaml`, replacing what that file held."""
        path = self.root / f"{name}.yaml"
        tmp = self.root / f".{name}.yaml.tmp"  # a dot file: never read as a manifest
        tmp.write_text(yaml.safe_dump_all(list(objects)))
        tmp.rename(path)
        return path

    def remove(self, name: str) -> None:
        (self.root / f"{name}.yaml").unlink()


def _yaml_fault(exc: yaml.YAMLError) -> str:
    """One line: where in the file, and what the parser expected."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = ", ".join(part for part in (exc.context, exc.problem) if part)
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
    return str(exc)


class ManifestsSource:
    """Snapshots of the watched kinds read from a directory, polled every `poll_interval`.

    A file that fails to parse keeps the objects it had when it last parsed; the rest of the
    directory still updates."""

    def __init__(
        self,
        directory: Path,
        *,
        poll_interval: float = 0.5,
        kinds: tuple[Kind, ...] = DESTINATION_KINDS,
    ) -> None:
        self._directory = directory
        self._kinds = kinds
        self._poll_interval = poll_interval
        self._stamps: Stamps = {}
        self._files: dict[Path, tuple[Object, ...]] = {}  # the last objects each file parsed to
        self._emitted: ByKind = {}
        self._listed: set[Kind] = set()

    @property
    def synced(self) -> bool:
        return self._listed.issuperset(self._kinds)

    async def run(self, sink: Sink) -> None:
        """Emits a Snapshot of every kind, then one of each kind that changes; until cancelled."""
        self._listed = set()  # a run that starts again (after a failure) lists again
        if not self._directory.is_dir():
            logger.warning("manifests directory %s does not exist (yet)", self._directory)
        stamps = await asyncio.to_thread(scan, self._directory)
        current = await asyncio.to_thread(self._load, stamps)
        self._emitted = current
        for kind in self._kinds:
            self._listed.add(kind)  # synced as the last kind's first Snapshot is delivered
            sink(Snapshot(kind, current[kind]))
        while True:
            await asyncio.sleep(self._poll_interval)
            stamps = await asyncio.to_thread(scan, self._directory)
            if stamps == self._stamps:
                continue
            current = await asyncio.to_thread(self._load, stamps)
            changed = changed_kinds(self._emitted, current)
            self._emitted = current
            for kind in changed:
                logger.info("manifests changed: %d %s", len(current[kind]), kind.plural)
                sink(Snapshot(kind, current[kind]))

    def _load(self, stamps: Stamps) -> ByKind:
        """Re-reads new and changed files; a file that fails keeps its previous objects."""
        files: dict[Path, tuple[Object, ...]] = {}
        for path, stamp in stamps.items():
            if self._stamps.get(path) == stamp and path in self._files:
                files[path] = self._files[path]
                continue
            try:
                files[path] = read_manifest(path)
            except ManifestError as exc:
                kept = self._files.get(path, ())
                logger.error("%s; keeping its previous %d objects", exc, len(kept))
                files[path] = kept
        self._stamps, self._files = stamps, files
        return group_by_kind((obj for path in sorted(files) for obj in files[path]), self._kinds)
