"""A real nginx on loopback for tests that need a server nobody here wrote: started with a
`server { ... }` body of the test's own, on a free port, in a folder of the test's; stopped at
the end. nginx comes from Debian (scripts/system-packages)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlet_testing.sockets import free_port

_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {root}/nginx.pid;
error_log stderr crit;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    server {{
        listen 127.0.0.1:{port};
        {server}
    }}
}}
"""


def binary() -> str:
    """nginx's path; skips the test without it (fails it where the suite must be whole)."""
    path = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(path):
        why = "nginx is not installed (scripts/system-packages installs it)"
        if os.environ.get("MESHLET_REQUIRE_NETNS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


@contextlib.contextmanager
def running(root: Path, server: str) -> Iterator[int]:
    """nginx serving `server` (the body of its `server` block); yields its port."""
    port = free_port()
    conf = root / "nginx.conf"
    conf.write_text(_CONF.format(root=root, port=port, server=server))
    process = subprocess.Popen([binary(), "-p", str(root), "-c", str(conf)],
                               stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                assert process.stderr is not None
                raise AssertionError(f"nginx exited: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline:
                raise AssertionError("nginx did not listen within 10s")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
