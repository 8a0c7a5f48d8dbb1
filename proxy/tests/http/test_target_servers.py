"""One request, one meaning, against servers nobody here wrote: aiohttp, nginx and Python's
http.server each serve a private resource at `/admin` and a public one at every other path.
Sent straight to them, spellings such as `/%61dmin` or `/x/../admin` reach `/admin` (the
folding an authorization bypass needs); through the proxy's HTTP/1 engine, the server serves
`/admin` exactly when the path the proxy routed (and would authorize) is `/admin`. curl sends
every spelling as written (`--path-as-is`)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from meshlet.api.target import EscapedSlashes
from meshlet.proxy.http.contract import HttpLimits
from meshlet.proxy.http.h1 import serve_h1
from meshlet_testing import nginx

SPELLINGS = ["/admin", "/%61dmin", "/adm%69n", "/./admin", "//admin", "/x/../admin",
             "/%2e/admin", "/%2E%2E/admin", "/x/%2e%2e/admin", "/admin/", "/ADMIN",
             "/admin;x", "/admin%2F", "/x/..%2Fadmin", "/%2Fadmin"]  # fmt: skip


async def curl(port: int, path: str) -> tuple[int, str]:
    """(status, body) of one GET sent as written."""
    process = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--path-as-is", "--max-time", "5", "-w", "\n%{http_code}",
        f"http://127.0.0.1:{port}{path}", stdout=subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate()
    body, _, code = out.decode().rpartition("\n")
    return int(code), body


@contextlib.asynccontextmanager
async def aiohttp_server() -> AsyncIterator[int]:
    async def admin(request: web.Request) -> web.Response:
        return web.Response(text="admin")

    async def public(request: web.Request) -> web.Response:
        return web.Response(text="public")

    app = web.Application()
    app.router.add_get("/admin", admin)
    app.router.add_get("/{tail:.*}", public)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def stdlib_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"admin" if self.path.partition("?")[0] == "/admin" else b"public"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


NGINX = 'location = /admin { return 200 "admin"; } location / { return 200 "public"; }'


@contextlib.asynccontextmanager
async def server(name: str, root: Path) -> AsyncIterator[int]:
    if name == "aiohttp":
        async with aiohttp_server() as port:
            yield port
    elif name == "nginx":
        with nginx.running(root, NGINX) as port:
            yield port
    else:
        with stdlib_server() as port:
            yield port


@pytest.mark.parametrize("name", ["aiohttp", "nginx", "http.server"])
async def test_the_server_serves_admin_exactly_when_the_proxy_routed_admin(
    name: str, engine_proxy: Any, tmp_path: Path
) -> None:
    async with server(name, tmp_path) as port:
        inbound = HttpLimits(escaped_slashes=EscapedSlashes.REJECT)  # a pod's proxy's default
        proxy = await engine_proxy(serve_h1, ("127.0.0.1", port), limits=inbound)
        folded = [path for path in SPELLINGS[1:] if (await curl(port, path))[1] == "admin"]
        if name != "http.server":  # it serves paths as they are sent
            assert "/%61dmin" in folded, folded
        for path in SPELLINGS:
            status, body = await curl(proxy.port, path)
            if status == 400:  # refused: nothing reached the server
                assert "%2F" in path, path
                continue
            assert status == 200, (path, status, body)
            assert (body == "admin") == (proxy.paths[-1] == "/admin"), (path, proxy.paths[-1])
            if path in folded and "%2F" not in path:  # folded by the proxy too
                assert body == "admin"


async def test_keeping_encoded_slashes_before_nginx_lets_it_serve_a_path_not_routed(
    engine_proxy: Any, tmp_path: Path
) -> None:
    """Why the inbound default is `reject`: nginx (as aiohttp) decodes `%2F` and then resolves
    dot segments, so under `keep` a path the proxy routes as `/x/..%2Fadmin` is `/admin` to
    it; `decode` routes what it serves."""
    with nginx.running(tmp_path, NGINX) as port:
        proxy = await engine_proxy(
            serve_h1, ("127.0.0.1", port), limits=HttpLimits(escaped_slashes=EscapedSlashes.KEEP)
        )
        assert await curl(proxy.port, "/x/..%2Fadmin") == (200, "admin")
        assert proxy.paths[-1] == "/x/..%2Fadmin"
        decoding = await engine_proxy(
            serve_h1, ("127.0.0.1", port),
            limits=HttpLimits(escaped_slashes=EscapedSlashes.DECODE),
        )  # fmt: skip
        assert await curl(decoding.port, "/x/..%2Fadmin") == (200, "admin")
        assert decoding.paths[-1] == "/admin"
