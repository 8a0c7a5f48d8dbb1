"""`meshlet-controller` as a process: flags, env, exit codes and graceful shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from meshlet_testing.sockets import free_port


def controller(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_missing_configuration_exits_64_naming_every_problem() -> None:
    proc = controller("identity")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 64
    assert "--issuer-dir is required" in err
    assert "--tokens-file is required" in err


def test_bad_address_exits_64() -> None:
    proc = controller("identity", "--addr", "nowhere")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 64
    assert "'nowhere' has no port (host:port)" in err


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_serves_until_sigterm(test_ca: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("t: {namespace: ns, serviceaccount: sa}\n")
    admin = free_port()
    # Flags from the environment, as in a container spec.
    proc = controller(
        "identity",
        env={
            "MESHLET_ADDR": f"127.0.0.1:{free_port()}",
            "MESHLET_ADMIN_ADDR": f"127.0.0.1:{admin}",
            "MESHLET_TRUST_ANCHORS": str(test_ca.anchors_path),
            "MESHLET_ISSUER_DIR": str(test_ca.issuer_dir),
            "MESHLET_TOKENS_FILE": str(tokens),
        },
    )
    try:
        deadline = time.monotonic() + 20
        while _status(admin, "/ready") != 200:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert "identity shutting down" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _flags(name: str, test_ca: Any, tmp_path: Path) -> list[str]:
    """What each controller needs, besides its addresses, to start on this machine."""
    if name == "identity":
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text("t: {namespace: ns, serviceaccount: sa}\n")
        return ["--trust-anchors", str(test_ca.anchors_path),
                "--issuer-dir", str(test_ca.issuer_dir), "--tokens-file", str(tokens)]  # fmt: skip
    if name == "destination":
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        return ["--manifests", str(manifests)]
    cert, key = test_ca.serving_cert("meshlet-proxy-injector.meshlet.svc", tmp_path / "tls")
    return ["--tls-cert", str(cert), "--tls-key", str(key),
            "--trust-anchors", str(test_ca.anchors_path)]  # fmt: skip


@pytest.mark.parametrize("flag", ["--addr", "--admin-addr"])
@pytest.mark.parametrize("name", ["destination", "identity", "injector"])
def test_an_address_in_use_is_one_line_and_exit_1(
    name: str, flag: str, test_ca: Any, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        addrs = {"--addr": f"127.0.0.1:{free_port()}", "--admin-addr": f"127.0.0.1:{free_port()}"}
        addrs[flag] = f"127.0.0.1:{port}"
        proc = controller(name, *(a for pair in addrs.items() for a in pair),
                          *_flags(name, test_ca, tmp_path))  # fmt: skip
        _, err = proc.communicate(timeout=30)
    what = "admin" if flag == "--admin-addr" else {"injector": "webhook"}.get(name, "gRPC")
    assert proc.returncode == 1, err
    assert err.strip().splitlines() == [
        f"meshlet-controller: cannot listen on 127.0.0.1:{port} ({what}): Address already in use"
    ]
