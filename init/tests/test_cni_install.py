"""`meshlet-cni-install` as the DaemonSet runs it: a real process against folders standing for
the node's (configuration, binaries, the plugin's roots), stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshlet.init import cni_install

INSTALL = str(Path(sys.executable).with_name("meshlet-cni-install"))
BRIDGE = {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local"}}


def primary(version: str = "1.0.0") -> dict[str, Any]:
    portmap = {"type": "portmap", "capabilities": {"portMappings": True}}
    return {"cniVersion": version, "name": "k8s-pod-network", "plugins": [BRIDGE, portmap]}


def wait_for(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    source = tmp_path / "image"  # a small root standing for the proxy image's
    (source / "usr" / "bin").mkdir(parents=True)
    (source / "usr" / "bin" / "python3").write_text("#!/bin/true\n")
    (source / "etc").mkdir()
    (source / "etc" / "os-release").write_text("ID=debian\n")
    (source / "bin").symlink_to("usr/bin")
    (source / "proc" / "1").mkdir(parents=True)  # a mount in a container: not copied
    folders = {name: tmp_path / name for name in ("net.d", "bin", "roots")}
    for path in folders.values():
        path.mkdir()
    return {**folders, "source": source, "ready": tmp_path / "ready"}


def start(node: dict[str, Path], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [INSTALL, f"--host-conf-dir={node['net.d']}", f"--host-bin-dir={node['bin']}",
         f"--host-root-dir={node['roots']}", "--node-root-dir=/opt/meshlet-cni",
         f"--source={node['source']}", "--python=/usr/bin/python3", "--interval=0.2",
         f"--ready-file={node['ready']}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_installs_keeps_and_removes_the_plugin(node: dict[str, Path]) -> None:
    conflist = node["net.d"] / "10-primary.conflist"
    later = node["net.d"] / "20-other.conflist"
    proc = start(node, '--settings={"proxy-uid": "2102", "mode": "nft"}')
    try:
        time.sleep(0.5)
        assert not node["ready"].exists()  # no configuration yet: not ready
        later.write_text(json.dumps(primary()))
        wait_for(node["ready"].exists, "ready once the node's CNI is configured")
        assert "meshlet-cni" in later.read_text()
        # a file before it in name order: the runtime's now, so meshlet-cni moves there
        conflist.write_text(json.dumps(primary()))
        wait_for(lambda: "meshlet-cni" in conflist.read_text(), "moved to the first file")
        doc = json.loads(conflist.read_text())
        assert [p["type"] for p in doc["plugins"]] == ["bridge", "portmap", "meshlet-cni"]
        assert doc["plugins"][2] == {
            "type": "meshlet-cni",
            "capabilities": {"io.kubernetes.cri.pod-annotations": True},
            "meshlet": {"proxy-uid": "2102", "mode": "nft"},
        }
        assert json.loads(later.read_text()) == primary()
        # the launcher names the copied root as the node sees it, and the root is complete
        (root,) = list(node["roots"].iterdir())
        launcher = (node["bin"] / "meshlet-cni").read_text()
        assert f"ROOT='/opt/meshlet-cni/{root.name}'" in launcher
        assert os.access(node["bin"] / "meshlet-cni", os.X_OK)
        assert (root / "usr/bin/python3").exists() and (root / "bin").is_symlink()
        assert (root / "proc").is_dir() and not (root / "proc" / "1").exists()
        assert (root / ".complete").exists()

        # the node's CNI rewrites its file: meshlet-cni is back within an interval
        conflist.write_text(json.dumps(primary()))
        wait_for(lambda: "meshlet-cni" in conflist.read_text(), "added again")
        assert len(json.loads(conflist.read_text())["plugins"]) == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert json.loads(conflist.read_text()) == primary()
    assert not (node["bin"] / "meshlet-cni").exists()
    assert list(node["roots"].iterdir()) == []
    assert "meshlet-cni removed from this node" in out


def test_a_single_plugin_conf_becomes_a_list(node: dict[str, Path]) -> None:
    conf = node["net.d"] / "05-bridge.conf"
    conf.write_text(json.dumps({"cniVersion": "0.4.0", "name": "net", **BRIDGE}))
    proc = start(node)
    try:
        wait_for(node["ready"].exists, "ready")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert not conf.exists()
    doc = json.loads((node["net.d"] / "05-bridge.conflist").read_text())
    assert doc == {"cniVersion": "0.4.0", "name": "net", "plugins": [BRIDGE]}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--settings=[1]"], "--settings must be a JSON object"),
        (['--settings={"proxy-guid": 1}'], "unknown settings proxy-guid"),
        (["--settings={"], "--settings is not JSON"),
        (["--node-root-dir=relative"], "not an absolute path"),
        (["--interval=0"], "--interval must be above 0"),
    ],
)
def test_bad_flags_exit_64_naming_the_problem(
    node: dict[str, Path], argv: list[str], says: str
) -> None:
    proc = start(node, *argv)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 64 and says in out and "Traceback" not in out, out
    assert list(node["bin"].iterdir()) == [] and list(node["roots"].iterdir()) == []


def test_a_configuration_is_changed_in_one_step() -> None:
    doc = primary()
    plugin = cni_install.entry({})
    once = cni_install.with_plugin(doc, plugin)
    assert cni_install.with_plugin(once, plugin) == once  # no second copy
    assert cni_install.without_plugin(once) == doc
    with pytest.raises(ValueError, match="absolute path"):
        cni_install.launcher("/opt/it's", "/usr/bin/python3")
