"""`meshlet demo` runs the identity flow with real processes and reports each step."""

from __future__ import annotations

import subprocess
import sys


def test_demo_certifies_two_proxies_and_completes_mtls() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshlet.cli.main", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "proxy web: certified as web.emojivoto.serviceaccount.identity." in out
    assert "proxy emoji: certified as emoji.emojivoto.serviceaccount.identity." in out
    assert "mTLS TLSv1.3 (ALPN transport.l5d.io/v1): web → emoji.emojivoto" in out
    assert "hello web.emojivoto.serviceaccount.identity.meshlet.cluster.local" in out
    assert out.rstrip().endswith("demo complete")
