"""`meshlet demo`: runs what the mesh has today on this machine, with real processes.

A fresh CA; the identity service as a `meshlet-controller identity` process with a tokens file;
two proxies' pre-start steps and Certify calls; then a mutual TLS 1.3 handshake between the two
issued identities, as two meshed proxies would make it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import click

from meshlet.api import wellknown

WORKLOADS = (("web", "emojivoto"), ("emoji", "emojivoto"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _identity_service(root: Path) -> Iterator[int]:
    tokens = root / "tokens.yaml"
    tokens.write_text(
        "".join(f"tok-{sa}: {{namespace: {ns}, serviceaccount: {sa}}}\n" for sa, ns in WORKLOADS)
    )
    port, admin = _free_port(), _free_port()
    argv = [
        sys.executable, "-m", "meshlet.controlplane.main", "identity",
        "--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
        "--trust-anchors", str(root / "ca" / "trust-anchors.pem"),
        "--issuer-dir", str(root / "ca" / "issuer"), "--tokens-file", str(tokens),
    ]  # fmt: skip
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 20
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1),
            ):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise click.ClickException("the identity service did not become ready")
            time.sleep(0.1)
        click.echo(f"identity service ready on 127.0.0.1:{port} (admin :{admin})")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=15)


async def _certify_and_handshake(root: Path, port: int) -> None:
    from meshlet.proxy.identity import prestart
    from meshlet.proxy.identity.certify import CertifyClient
    from meshlet.proxy.tls import contexts

    anchors = (root / "ca" / "trust-anchors.pem").read_text()
    files: dict[str, tuple[Path, Path]] = {}
    for sa, ns in WORKLOADS:
        name = wellknown.identity_name(sa, ns)
        directory = root / "proxies" / sa
        ids = prestart.prepare_in_child(directory, name)
        client = CertifyClient("127.0.0.1", port, wellknown.IDENTITY_SERVICE_NAME, anchors)
        try:
            cert = await client.certify(name, f"tok-{sa}".encode(), ids.csr.read_bytes())
        finally:
            client.close()
        files[sa] = (
            contexts.write_chain(directory, cert.leaf_der, cert.intermediates_der),
            ids.key,
        )
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cert.valid_until))
        click.echo(f"proxy {sa}: certified as {name}, valid until {until}")

    server_name = wellknown.identity_name(*WORKLOADS[1])
    server_ctx = contexts.server_context(*files["emoji"], anchors, require_client_cert=True)
    client_ctx = contexts.client_context(*files["web"], anchors)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = contexts.peer_identity(writer.get_extra_info("ssl_object"))
        writer.write(f"hello {peer}\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    async with server:
        server_port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server_port, ssl=client_ctx, server_hostname=server_name
        )
        tls = writer.get_extra_info("ssl_object")
        greeting = (await reader.readline()).decode().strip()
        click.echo(
            f"mTLS {tls.version()} (ALPN {tls.selected_alpn_protocol()}): web → "
            f"{contexts.peer_identity(tls)}; the server said: {greeting!r}"
        )
        writer.close()


@click.command()
@click.option("--keep", is_flag=True, help="Keep the working folder (certificates, keys).")
def demo(keep: bool) -> None:
    """Run the identity flow of the mesh locally (the local mesh of network namespaces and
    proxies is not part of this build yet)."""
    from meshlet.cli.main import main as meshlet

    root = Path(tempfile.mkdtemp(prefix="meshlet-demo-"))
    os.chmod(root, 0o700)
    try:
        with contextlib.suppress(SystemExit):
            meshlet(["identity", "ca", "create", "--out", str(root / "ca")])
        with _identity_service(root) as port:
            asyncio.run(_certify_and_handshake(root, port))
        click.echo("demo complete")
    finally:
        if keep:
            click.echo(f"working folder kept: {root}")
        else:
            subprocess.run(["rm", "-rf", str(root)], check=False)
