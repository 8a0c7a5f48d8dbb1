"""`meshlet-cni-install`: puts `meshlet-cni` on a node and keeps it in the node's CNI
configuration, as the meshlet-cni DaemonSet's container (Linkerd's install-cni).

The plugin is Python, and a node has no Python of its own to run it with, so the installer
copies its own root (the proxy image's files: Python, meshlet, iptables) to the node
(`--host-root-dir`, one folder per build of meshlet, made complete before it is used) and writes
a launcher script in the node's CNI binary folder. The launcher enters the pod's network
namespace, makes a mount namespace of its own that sees the node's /proc and /dev in that root,
and runs the plugin there (`meshlet.init.cni --entered`); it needs only a shell, util-linux
(nsenter, unshare, mount) and coreutils (chroot) on the node.

Then it appends meshlet-cni to the node's network configuration, the first file of the
configuration folder in the order the runtime reads them (a single-plugin `.conf` becomes a
`.conflist`), asking the runtime for the pods' annotations, and checks every `--interval` that
it is still there (a primary CNI that rewrites its file removes it). On SIGTERM or SIGINT it
takes meshlet-cni out of the configuration, then removes the launcher and the copied roots: pods
made after that are not redirected, and their validators say so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from meshlet.init.cni import ANNOTATIONS_CAPABILITY, SETTINGS

log = logging.getLogger("meshlet-cni-install")

PLUGIN: Final = "meshlet-cni"
CONFIG_SUFFIXES: Final = (".conf", ".conflist", ".json")  # what libcni reads, in name order
# The parts of the installer's own root copied to the node; the rest are mounts or scratch.
ROOT_PARTS: Final = ("bin", "etc", "lib", "lib64", "opt", "sbin", "usr", "var")
EMPTY_PARTS: Final = ("dev", "proc", "run", "sys", "tmp")
EX_CONFIG: Final = 64

LAUNCHER: Final = """\
#!/bin/sh
# meshlet-cni, written by the meshlet-cni DaemonSet (meshlet-cni-install): do not edit.
# The plugin runs in its own root, ROOT below (Python, meshlet, iptables), in a mount
# namespace of its own that sees the node's /proc and /dev, after entering the pod's network
# namespace. A missing tool is a CNI error, as the spec asks.
ROOT='{root}'
PYTHON='{python}'
fail() {{
  printf '{{"cniVersion":"1.1.0","code":%s,"msg":"%s"}}\\n' "$1" "$2"
  exit 1
}}
for tool in nsenter unshare chroot mount; do
  command -v "$tool" >/dev/null 2>&1 || fail 50 "meshlet-cni needs $tool on the node"
done
[ -x "$ROOT$PYTHON" ] || fail 50 "meshlet-cni's root $ROOT is missing on the node"
INNER='mount --rbind /proc "$0/proc" && mount --rbind /dev "$0/dev" && exec chroot "$0" "$@"'
if [ -n "${{CNI_NETNS:-}}" ] && [ -e "$CNI_NETNS" ]; then
  exec nsenter --net="$CNI_NETNS" -- unshare --mount --propagation private -- \\
    sh -c "$INNER" "$ROOT" "$PYTHON" -m meshlet.init.cni --entered
fi
exec unshare --mount --propagation private -- sh -c "$INNER" "$ROOT" "$PYTHON" -m meshlet.init.cni
"""


def launcher(root: str, python: str) -> str:
    """The launcher script for a root as the node sees it and the Python inside it."""
    for value in (root, python):
        if "'" in value or not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path without quotes")
    return LAUNCHER.format(root=root.rstrip("/") or "/", python=python)


def entry(settings: dict[str, Any]) -> dict[str, Any]:
    """meshlet-cni's place in a configuration list."""
    return {"type": PLUGIN, "capabilities": {ANNOTATIONS_CAPABILITY: True}, "meshlet": settings}


def with_plugin(doc: dict[str, Any], plugin: dict[str, Any]) -> dict[str, Any]:
    """The configuration with meshlet-cni last (replacing any earlier meshlet-cni)."""
    if isinstance(doc.get("plugins"), list):
        kept = [p for p in doc["plugins"] if not (isinstance(p, dict) and p.get("type") == PLUGIN)]
        return {**doc, "plugins": [*kept, plugin]}
    first = {k: v for k, v in doc.items() if k not in ("cniVersion", "name", "disableCheck")}
    out: dict[str, Any] = {k: doc[k] for k in ("cniVersion", "name", "disableCheck") if k in doc}
    return {**out, "plugins": [first, plugin]}


def without_plugin(doc: dict[str, Any]) -> dict[str, Any]:
    plugins = doc.get("plugins")
    if not isinstance(plugins, list):
        return doc
    kept = [p for p in plugins if not (isinstance(p, dict) and p.get("type") == PLUGIN)]
    return {**doc, "plugins": kept}


def first_config(folder: Path) -> Path | None:
    """The configuration the runtime uses: the first of the folder's files in name order."""
    try:
        names = sorted(p for p in folder.iterdir()
                       if p.suffix in CONFIG_SUFFIXES and p.is_file())  # fmt: skip
    except OSError:
        return None
    return names[0] if names else None


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Written beside, then renamed: a reader sees the old file or the new, never half."""
    part = path.with_name(f".{path.name}.meshlet-part")
    part.write_text(text)
    part.chmod(mode)
    os.replace(part, path)


def build_stamp() -> str:
    """Names this build of meshlet: its version and the hash of its files' record."""
    dist = metadata.distribution("meshlet")
    record = dist.read_text("RECORD") or dist.read_text("direct_url.json") or ""
    return f"{dist.version}-{hashlib.sha256(record.encode()).hexdigest()[:12]}"


def copy_root(source: Path, folder: Path, stamp: str) -> Path:
    """`source`'s files copied to `folder/stamp` (kept when already complete)."""
    done = folder / stamp
    if (done / ".complete").exists():
        return done
    part = folder / f".{stamp}.part"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    for name in ROOT_PARTS:
        src = source / name
        if src.is_symlink():
            (part / name).symlink_to(os.readlink(src))
        elif src.is_dir():
            shutil.copytree(src, part / name, symlinks=True)
    for name in EMPTY_PARTS:
        (part / name).mkdir(exist_ok=True)
    (part / ".complete").write_text(stamp + "\n")
    shutil.rmtree(done, ignore_errors=True)
    os.replace(part, done)
    return done


class Installer:
    def __init__(self, args: argparse.Namespace, settings: dict[str, Any]) -> None:
        self.conf_dir = Path(args.host_conf_dir)
        self.bin_dir = Path(args.host_bin_dir)
        self.roots = Path(args.host_root_dir)
        self.node_roots = args.node_root_dir
        self.source = Path(args.source)
        self.python = args.python
        self.plugin = entry(settings)
        self.ready = Path(args.ready_file) if args.ready_file else None
        self.config: Path | None = None
        self._waiting = False

    def install(self) -> None:
        stamp = build_stamp()
        root = copy_root(self.source, self.roots, stamp)
        node_root = f"{self.node_roots.rstrip('/')}/{root.name}"
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.bin_dir / PLUGIN, launcher(node_root, self.python), 0o755)
        for old in self.roots.iterdir():  # earlier builds' roots
            if old.name != root.name:
                shutil.rmtree(old, ignore_errors=True)
        log.info("meshlet-cni %s installed in %s (root %s)", stamp, self.bin_dir, node_root)

    def keep(self) -> None:
        """meshlet-cni in the first configuration (and only there), as it should be."""
        current = first_config(self.conf_dir)
        if current is None:
            if not self._waiting:
                log.info("no network configuration in %s yet: waiting for the node's CNI",
                         self.conf_dir)  # fmt: skip
            self._waiting = True
            return
        self._waiting = False
        if self.config is not None and self.config != current and self.config.exists():
            self._remove_from(self.config)
        doc = _read(current)
        if doc is None:
            return
        wanted = with_plugin(doc, self.plugin)
        if wanted != doc:
            listed = isinstance(doc.get("plugins"), list)
            target = current if listed else current.with_suffix(".conflist")
            write_atomic(target, json.dumps(wanted, indent=2) + "\n")
            if target != current:
                current.unlink(missing_ok=True)
            log.info("meshlet-cni added to %s", target)
            current = target
        self.config = current
        if self.ready is not None and not self.ready.exists():
            self.ready.write_text("ready\n")

    def uninstall(self) -> None:
        for path in {p for p in (self.config, first_config(self.conf_dir)) if p is not None}:
            self._remove_from(path)
        (self.bin_dir / PLUGIN).unlink(missing_ok=True)
        if self.roots.exists():
            for old in self.roots.iterdir():
                shutil.rmtree(old, ignore_errors=True)
        log.info("meshlet-cni removed from this node")

    def _remove_from(self, path: Path) -> None:
        doc = _read(path)
        if doc is not None and without_plugin(doc) != doc:
            write_atomic(path, json.dumps(without_plugin(doc), indent=2) + "\n")
            log.info("meshlet-cni taken out of %s", path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read the network configuration %s: %s", path, exc)
        return None
    if not isinstance(doc, dict):
        log.warning("the network configuration %s is not a JSON object", path)
        return None
    return doc


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="meshlet-cni-install",
        description="Install meshlet-cni on this node and keep it chained in the node's CNI"
        " configuration until SIGTERM, which removes it (the meshlet-cni DaemonSet's container).",
    )
    add = result.add_argument
    add(
        "--host-conf-dir",
        default="/host/etc/cni/net.d",
        help="the node's CNI configuration folder, as mounted here",
    )
    add(
        "--host-bin-dir",
        default="/host/opt/cni/bin",
        help="the node's CNI binary folder, as mounted here",
    )
    add(
        "--host-root-dir",
        default="/host/opt/meshlet-cni",
        help="where the plugin's root is copied, as mounted here",
    )
    add(
        "--node-root-dir",
        default="/opt/meshlet-cni",
        help="the same folder as the node sees it (the launcher's path)",
    )
    add("--source", default="/", help="the root to copy (this container's)")
    add("--python", default=sys.executable, help="the Python of the copied root")
    add(
        "--settings",
        default="{}",
        help="meshlet-cni's settings, a JSON object: meshlet-init's flags by name"
        f" ({', '.join(SETTINGS)})",
    )
    add(
        "--interval",
        type=float,
        default=2.0,
        help="seconds between checks that meshlet-cni is still configured",
    )
    add(
        "--ready-file",
        default="/tmp/meshlet-cni-ready",
        help="written once meshlet-cni is configured (the readiness probe's); '' for none",
    )
    return result  # fmt: skip


def _settings(text: str) -> dict[str, Any]:
    try:
        settings = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--settings is not JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError("--settings must be a JSON object")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"--settings: unknown settings {', '.join(unknown)}"
                         f" (known: {', '.join(SETTINGS)})")  # fmt: skip
    return settings


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parser().parse_args(argv)
    try:
        settings = _settings(args.settings)
        if args.interval <= 0:
            raise ValueError("--interval must be above 0")
        launcher(args.node_root_dir, args.python)
    except ValueError as exc:
        sys.stderr.write(f"meshlet-cni-install: {exc}\n")
        sys.exit(EX_CONFIG)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    installer = Installer(args, settings)
    try:
        installer.install()
        while not stop.is_set():
            installer.keep()
            stop.wait(args.interval)
    except OSError as exc:
        log.error("cannot install meshlet-cni: %s", exc)
        installer.uninstall()
        sys.exit(1)
    installer.uninstall()


if __name__ == "__main__":
    main()
