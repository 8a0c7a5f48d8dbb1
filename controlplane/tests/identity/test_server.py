"""The identity service end to end: real TLS gRPC on 127.0.0.1, real certificates in use."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshlet.api import identity_pb2, identity_pb2_grpc, wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.identity import ca
from meshlet.controlplane.identity.server import IdentityConfig, IdentityServer
from meshlet.proxy.identity import prestart
from meshlet.proxy.identity.certify import CertifyClient, CertifyFailed
from meshlet.proxy.tls import contexts
from meshlet_testing.polling import eventually

WEB = wellknown.identity_name("web", "emojivoto")
TOKENS = """
tok-web: {namespace: emojivoto, serviceaccount: web}
tok-db: {namespace: emojivoto, serviceaccount: db}
"""


def identity_server(
    test_ca: Any, tmp_path: Path, issuer_dir: Path | None = None, **kw: Any
) -> IdentityServer:
    """An identity service on 127.0.0.1 (ephemeral ports) with the test CA and tokens file."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(TOKENS)
    config = IdentityConfig(
        addr=HostPort("127.0.0.1", 0),
        admin_addr=HostPort("127.0.0.1", 0),
        trust_anchors=test_ca.anchors_path,
        issuer_dir=issuer_dir or test_ca.issuer_dir,
        tokens_file=tokens,
        kube_api=None,
        reload_interval=kw.pop("reload_interval", 0.1),
    )
    return IdentityServer(config, **kw)


@pytest.fixture
async def server(test_ca: Any, tmp_path: Path) -> AsyncIterator[IdentityServer]:
    srv = identity_server(test_ca, tmp_path)
    await srv.start()
    yield srv
    await srv.stop(grace=0)


def grpc_channel(server: IdentityServer, anchors: bytes) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=anchors)
    return grpc.aio.secure_channel(
        f"127.0.0.1:{server.grpc_port}",
        creds,
        options=[("grpc.ssl_target_name_override", wellknown.IDENTITY_SERVICE_NAME)],
    )


def csr_for(name: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.DER)
    )


async def certify(server: IdentityServer, anchors: bytes, **fields: Any) -> Any:
    request = {"identity": WEB, "token": b"tok-web", "certificate_signing_request": csr_for(WEB)}
    request.update(fields)
    async with grpc_channel(server, anchors) as channel:
        stub = identity_pb2_grpc.IdentityStub(channel)
        return await stub.Certify(identity_pb2.CertifyRequest(**request), timeout=5)


async def test_proxy_identity_completes_mutual_tls13(
    server: IdentityServer, test_ca: Any, tmp_path: Path
) -> None:
    """The proxy's own path: pre-start key + CSR, grpclib Certify, ssl contexts, a handshake."""
    anchors = test_ca.anchors_pem
    identities = {}
    for name in ("web", "db"):
        directory = tmp_path / name
        files = prestart.prepare(directory, wellknown.identity_name(name, "emojivoto"))
        assert files.key.stat().st_mode & 0o777 == 0o600
        client = CertifyClient(
            "127.0.0.1", server.grpc_port, wellknown.IDENTITY_SERVICE_NAME, anchors
        )
        try:
            cert = await client.certify(
                wellknown.identity_name(name, "emojivoto"),
                f"tok-{name}".encode(),
                files.csr.read_bytes(),
            )
        finally:
            client.close()
        assert cert.valid_until == pytest.approx(
            dt.datetime.now(dt.UTC).timestamp() + 24 * 3600 + 20, abs=10
        )
        chain = contexts.write_chain(directory, cert.leaf_der, cert.intermediates_der)
        identities[name] = (chain, files.key)

    server_ctx = contexts.server_context(*identities["db"], anchors, require_client_cert=True)
    client_ctx = contexts.client_context(*identities["web"], anchors)
    seen: dict[str, Any] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        seen["client"] = contexts.peer_identity(ssl_object)
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = listener.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection(
        "127.0.0.1",
        port,
        ssl=client_ctx,
        server_hostname=wellknown.identity_name("db", "emojivoto"),
    )
    ssl_object = writer.get_extra_info("ssl_object")
    assert ssl_object.version() == "TLSv1.3"
    assert ssl_object.selected_alpn_protocol() == wellknown.TRANSPORT_ALPN
    assert contexts.peer_identity(ssl_object) == wellknown.identity_name("db", "emojivoto")
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    assert seen["client"] == WEB
    writer.close()
    listener.close()
    await listener.wait_closed()


async def test_client_refuses_server_claiming_another_identity(
    server: IdentityServer, test_ca: Any
) -> None:
    client = CertifyClient(
        "127.0.0.1", server.grpc_port, "not-identity.example", test_ca.anchors_pem
    )
    try:
        with pytest.raises(CertifyFailed) as caught:
            await client.certify(WEB, b"tok-web", csr_for(WEB))
    finally:
        client.close()
    assert caught.value.status == "UNAVAILABLE"
    assert "certificate" in caught.value.message.lower() or "hostname" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "code", "detail"),
    [
        ({"identity": ""}, grpc.StatusCode.INVALID_ARGUMENT, "missing field"),
        ({"token": b""}, grpc.StatusCode.INVALID_ARGUMENT, "missing field"),
        ({"certificate_signing_request": b""}, grpc.StatusCode.INVALID_ARGUMENT, "missing"),
        ({"certificate_signing_request": b"\x30garbage"}, grpc.StatusCode.INVALID_ARGUMENT, "DER"),
        ({"token": b"\xff\xfe"}, grpc.StatusCode.INVALID_ARGUMENT, "ASCII"),
        ({"token": b"tok-unknown"}, grpc.StatusCode.FAILED_PRECONDITION, "not authenticated"),
        ({"token": b"tok-db"}, grpc.StatusCode.FAILED_PRECONDITION, "token proves db."),
        (
            {"certificate_signing_request": csr_for("db.emojivoto.serviceaccount.identity.x.y")},
            grpc.StatusCode.FAILED_PRECONDITION,
            "exactly one DNS SAN",
        ),
    ],
    ids=[
        "no-identity",
        "no-token",
        "no-csr",
        "garbage-csr",
        "binary-token",
        "unknown-token",
        "someone-elses-token",
        "csr-for-other-name",
    ],
)
async def test_error_codes_over_the_wire(
    server: IdentityServer,
    test_ca: Any,
    fields: dict[str, Any],
    code: grpc.StatusCode,
    detail: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await certify(server, test_ca.anchors_path.read_bytes(), **fields)
    assert caught.value.code() == code
    assert detail in (caught.value.details() or "")


async def test_oversized_request_is_refused_and_service_lives(
    server: IdentityServer, test_ca: Any
) -> None:
    anchors = test_ca.anchors_path.read_bytes()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await certify(server, anchors, certificate_signing_request=b"\x30" * (1 << 20))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    response = await certify(server, anchors)
    assert response.leaf_certificate


async def test_issuer_rotation_is_picked_up(server: IdentityServer, test_ca: Any) -> None:
    anchors = test_ca.anchors_path.read_bytes()
    first = await certify(server, anchors)
    assert first.intermediate_certificates == [
        test_ca.issuer.public_bytes(serialization.Encoding.DER)
    ]
    new_issuer = test_ca.rotate_issuer()
    new_der = new_issuer.public_bytes(serialization.Encoding.DER)
    for _ in range(50):
        response = await certify(server, anchors)
        if list(response.intermediate_certificates) == [new_der]:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("rotated issuer never used")
    x509.load_der_x509_certificate(response.leaf_certificate).verify_directly_issued_by(new_issuer)
    # The service's own serving certificate moved to the new issuer too.
    leaf = server.serving.leaf
    assert leaf is not None
    x509.load_der_x509_certificate(leaf.der).verify_directly_issued_by(new_issuer)


async def test_bad_rotation_keeps_the_old_issuer(
    server: IdentityServer, test_ca: Any, tmp_path: Path
) -> None:
    anchors = test_ca.anchors_path.read_bytes()
    before = server.holder.issuer
    now = dt.datetime.now(dt.UTC)
    stranger, stranger_key = ca.create_trust_anchor(now)
    foreign, foreign_key = ca.create_issuer(stranger, stranger_key, now)
    (test_ca.issuer_dir / "crt.pem").write_bytes(ca.cert_pem(foreign))
    (test_ca.issuer_dir / "key.pem").write_bytes(ca.key_pem(foreign_key))
    await eventually(lambda: bool(server.holder.last_error))
    assert "does not chain to the trust anchors" in (server.holder.last_error or "")
    assert server.holder.issuer is before
    assert (await certify(server, anchors)).leaf_certificate


async def test_expired_issuer_is_unavailable(test_ca: Any, tmp_path: Path) -> None:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    test_ca.rotate_issuer(now=long_ago, lifetime=dt.timedelta(days=2, hours=23, minutes=59))
    srv = identity_server(test_ca, tmp_path)
    # An expired issuer is never loaded: the service waits, not ready, saying why.
    task = asyncio.create_task(srv.start())
    await eventually(lambda: srv.holder.last_error is not None)
    assert "expired" in srv.holder.last_error
    assert not srv.ready()
    assert not task.done()
    assert (await asyncio.to_thread(_get, srv.admin_port, "/ready"))[0] == 503
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await srv.stop(grace=0)


async def test_issuer_expiring_while_serving_is_unavailable(test_ca: Any, tmp_path: Path) -> None:
    """The issuer loaded at start expires later: Certify answers UNAVAILABLE, never an
    expired leaf. The service's clock is moved past the issuer's expiry; TLS still uses the
    real clock, so the request reaches the service."""
    late = test_ca.issuer.not_valid_after_utc + dt.timedelta(seconds=1)
    srv = identity_server(test_ca, tmp_path, clock=lambda: late)
    await srv.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certify(srv, test_ca.anchors_path.read_bytes())
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "issuer expired" in (caught.value.details() or "")
    finally:
        await srv.stop(grace=0)


async def test_waits_for_issuer_then_serves(test_ca: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty-issuer"
    empty.mkdir()
    srv = identity_server(test_ca, tmp_path, issuer_dir=empty, reload_interval=0.05)
    task = asyncio.create_task(srv.start())
    try:
        await eventually(lambda: bool(srv.admin_port))
        assert (await asyncio.to_thread(_get, srv.admin_port, "/ready"))[0] == 503
        assert (await asyncio.to_thread(_get, srv.admin_port, "/live"))[0] == 200
        for name in ("crt.pem", "key.pem"):
            (empty / name).write_bytes((test_ca.issuer_dir / name).read_bytes())
        await asyncio.wait_for(task, 5)
        assert (await asyncio.to_thread(_get, srv.admin_port, "/ready"))[0] == 200
        assert (await certify(srv, test_ca.anchors_path.read_bytes())).leaf_certificate
    finally:
        task.cancel()
        await srv.stop(grace=0)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_admin_metrics(server: IdentityServer, test_ca: Any) -> None:
    anchors = test_ca.anchors_path.read_bytes()
    await certify(server, anchors)
    with pytest.raises(grpc.aio.AioRpcError):
        await certify(server, anchors, token=b"tok-db")
    status, body = await asyncio.to_thread(_get, server.admin_port, "/metrics")
    assert status == 200
    samples = dict(
        line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#")
    )
    expiry = float(samples["identity_cert_expiration_timestamp_seconds"])
    assert expiry == test_ca.issuer.not_valid_after_utc.timestamp()
    assert (
        'grpc_server_handled_total{grpc_code="OK",grpc_method="Certify",'
        'grpc_service="io.linkerd.proxy.identity.Identity",grpc_type="unary"} 1.0'
    ) in body
    assert 'grpc_code="FAILED_PRECONDITION",grpc_method="Certify"' in body
    assert (await asyncio.to_thread(_get, server.admin_port, "/ready"))[0] == 200
    assert (await asyncio.to_thread(_get, server.admin_port, "/nope"))[0] == 404


def test_tls_context_refuses_tls12(test_ca: Any) -> None:
    ctx = contexts.client_context(None, None, test_ca.anchors_pem)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
