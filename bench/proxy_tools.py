"""The proxy benchmark's tools: which are installed, installing the missing ones, versions.

Missing tools are installed with `apt-get install -y` when running as root; otherwise (or when
apt fails) they stay missing and the benchmark prints a "not installed" row for what needs them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.proxy_configs import NGINX_STREAM_MODULE


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    packages: tuple[str, ...]  # the Debian packages that provide it
    version_argv: tuple[str, ...] = ()
    path: Path | None = None  # for what is a file rather than a command on PATH

    def installed(self) -> bool:
        return self.path.exists() if self.path else shutil.which(self.name) is not None


TOOLS: Final = (
    Tool("wrk", ("wrk",), ("wrk", "-v")),
    Tool("h2load", ("nghttp2-client",), ("h2load", "--version")),  # nghttp (probes) comes along
    Tool("nginx", ("nginx",), ("nginx", "-v")),
    Tool("nginx-stream", ("libnginx-mod-stream",), path=NGINX_STREAM_MODULE),
    Tool("haproxy", ("haproxy",), ("haproxy", "-v")),
    Tool("iperf3", ("iperf3",), ("iperf3", "-v")),
)


def ensure_installed() -> dict[str, str]:
    """Install what is missing (root only); returns tool name → why it is still missing."""
    absent = [tool for tool in TOOLS if not tool.installed()]
    if absent and os.geteuid() == 0 and shutil.which("apt-get"):
        packages = sorted({p for tool in absent for p in tool.packages})
        print(f"installing {' '.join(packages)} ...", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            # the package lists may be stale or absent: refresh them and try once more
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
    return missing(
        "not installed (apt-get failed)" if os.geteuid() == 0 else "not installed (not root)"
    )


def missing(reason: str) -> dict[str, str]:
    """Tool name → `reason`, for every tool that is not installed."""
    return {tool.name: reason for tool in TOOLS if not tool.installed()}


def version(tool: Tool) -> str:
    """The first version-looking word the tool prints about itself."""
    if not tool.version_argv or not tool.installed():
        return ""
    result = subprocess.run(tool.version_argv, capture_output=True, text=True)
    match = re.search(r"\d+\.\d+(\.\d+)?", result.stdout + result.stderr)
    return match[0] if match else "?"


def versions() -> str:
    """`wrk 4.1.0, h2load 1.52.0, ...` for the installed tools."""
    return ", ".join(f"{tool.name} {v}" for tool in TOOLS if (v := version(tool)))
