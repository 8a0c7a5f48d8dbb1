"""The identity service against the Kubernetes API (the fake API server, the real client):
TokenReview for tokens, and the issuer from Secret + ConfigMap, hot-reloaded."""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes import client

from meshlet.api import identity_pb2, identity_pb2_grpc, wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.identity import ca
from meshlet.controlplane.identity.errors import CertifyError
from meshlet.controlplane.identity.server import IdentityConfig, IdentityServer
from meshlet.controlplane.identity.source import IssuerHolder, KubernetesIssuerSource
from meshlet.controlplane.identity.tokens import ServiceAccount, TokenReviewer
from meshlet.proxy.identity import prestart
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.polling import eventually

WEB = wellknown.identity_name("web", "emojivoto")


@pytest.fixture
def kube() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as api:
        api.add_token("tok-web", "system:serviceaccount:emojivoto:web")
        api.add_token("tok-wrong-aud", "system:serviceaccount:emojivoto:web", audiences=("api",))
        api.add_token("tok-user", "alice")
        yield api


def _issuer_objects(test_ca: Any) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": wellknown.ISSUER_SECRET, "namespace": "meshlet"},
            "data": {
                key: base64.b64encode((test_ca.issuer_dir / key).read_bytes()).decode()
                for key in (wellknown.ISSUER_CERT_KEY, wellknown.ISSUER_KEY_KEY)
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": wellknown.TRUST_ROOTS_CONFIGMAP, "namespace": "meshlet"},
            "data": {wellknown.TRUST_ROOTS_KEY: test_ca.anchors_pem},
        },
    ]


@pytest.fixture
async def server(kube: FakeKubeAPI, test_ca: Any) -> AsyncIterator[IdentityServer]:
    for obj in _issuer_objects(test_ca):
        kube.apply(obj)
    with client.ApiClient(kube.client_configuration()) as api_client:
        srv = IdentityServer(
            IdentityConfig(
                addr=HostPort("127.0.0.1", 0),
                admin_addr=HostPort("127.0.0.1", 0),
                trust_anchors=None,
                issuer_dir=None,
                tokens_file=None,
                kube_api=api_client,
                reload_interval=0.1,
            )
        )
        await srv.start()
        yield srv
        await srv.stop(grace=0)


async def certify(srv: IdentityServer, anchors: bytes, token: bytes, tmp: Path) -> Any:
    files = prestart.prepare(tmp, WEB)
    creds = grpc.ssl_channel_credentials(root_certificates=anchors)
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{srv.grpc_port}",
        creds,
        options=[("grpc.ssl_target_name_override", wellknown.IDENTITY_SERVICE_NAME)],
    ) as channel:
        return await identity_pb2_grpc.IdentityStub(channel).Certify(
            identity_pb2.CertifyRequest(
                identity=WEB, token=token, certificate_signing_request=files.csr.read_bytes()
            ),
            timeout=10,
        )


async def test_token_review_grants_the_service_account(
    server: IdentityServer, kube: FakeKubeAPI, test_ca: Any, tmp_path: Path
) -> None:
    response = await certify(server, test_ca.anchors_path.read_bytes(), b"tok-web", tmp_path)
    leaf = x509.load_der_x509_certificate(response.leaf_certificate)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [WEB]
    assert ("POST", "/apis/authentication.k8s.io/v1/tokenreviews") in kube.requests


@pytest.mark.parametrize(
    ("token", "detail"),
    [
        (b"tok-unknown", "not authenticated"),
        (b"tok-wrong-aud", "not authenticated"),
        (b"tok-user", "'alice' is not a service account"),
    ],
)
async def test_token_review_refusals(
    server: IdentityServer, test_ca: Any, tmp_path: Path, token: bytes, detail: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await certify(server, test_ca.anchors_path.read_bytes(), token, tmp_path)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert detail in (caught.value.details() or "")


async def test_api_server_failure_is_unavailable(
    server: IdentityServer, kube: FakeKubeAPI, test_ca: Any, tmp_path: Path
) -> None:
    kube.fail_token_reviews = True
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await certify(server, test_ca.anchors_path.read_bytes(), b"tok-web", tmp_path)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_reviewer_maps_review_status(kube: FakeKubeAPI) -> None:
    with client.ApiClient(kube.client_configuration()) as api_client:
        reviewer = TokenReviewer(api_client)
        assert await reviewer.validate("tok-web") == ServiceAccount("emojivoto", "web")
        with pytest.raises(CertifyError):
            await reviewer.validate("tok-wrong-aud")


async def test_issuer_rotation_through_the_secret(
    server: IdentityServer, kube: FakeKubeAPI, test_ca: Any, tmp_path: Path
) -> None:
    anchors = test_ca.anchors_path.read_bytes()
    new_issuer = test_ca.rotate_issuer()
    kube.apply(_issuer_objects(test_ca)[0])
    new_der = new_issuer.public_bytes(serialization.Encoding.DER)
    for attempt in range(50):
        response = await certify(server, anchors, b"tok-web", tmp_path / str(attempt))
        if list(response.intermediate_certificates) == [new_der]:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the rotated issuer in the Secret was never used")


async def test_issuer_secret_from_another_anchor_is_refused(
    server: IdentityServer, kube: FakeKubeAPI, test_ca: Any
) -> None:
    import datetime as dt

    before = server.holder.issuer
    now = dt.datetime.now(dt.UTC)
    stranger, stranger_key = ca.create_trust_anchor(now)
    foreign, foreign_key = ca.create_issuer(stranger, stranger_key, now)
    secret = _issuer_objects(test_ca)[0]
    secret["data"] = {
        wellknown.ISSUER_CERT_KEY: base64.b64encode(ca.cert_pem(foreign)).decode(),
        wellknown.ISSUER_KEY_KEY: base64.b64encode(ca.key_pem(foreign_key)).decode(),
    }
    kube.apply(secret)
    await eventually(lambda: bool(server.holder.last_error))
    assert "does not chain to the trust anchors" in (server.holder.last_error or "")
    assert server.holder.issuer is before


def test_an_unreachable_api_server_keeps_the_issuer_in_force(
    kube: FakeKubeAPI, test_ca: Any
) -> None:
    """A reload while the API server cannot be reached fails like any other: the issuer in
    force stays, and the watch (under the supervisor) does not die of it."""
    for obj in _issuer_objects(test_ca):
        kube.apply(obj)
    with client.ApiClient(kube.client_configuration()) as api_client:
        holder = IssuerHolder(KubernetesIssuerSource(api_client, "meshlet"))
        assert holder.reload() and holder.issuer is not None
        loaded = holder.issuer
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        api_client.configuration.host = f"https://127.0.0.1:{port}"
        api_client.rest_client.pool_manager.clear()
        assert holder.reload() is False
    assert "cannot reach the Kubernetes API server" in (holder.last_error or "")
    assert holder.issuer is loaded


async def test_a_cert_manager_issuer_secret_is_used_and_its_renewal_followed(
    kube: FakeKubeAPI, test_ca: Any, tmp_path: Path
) -> None:
    """--issuer-scheme kubernetes.io/tls (the chart's identity.issuer.scheme): the issuer in a
    kubernetes.io/tls Secret as cert-manager writes it (tls.crt, tls.key, ca.crt); when
    cert-manager renews it with a new issuer under the same anchor, the next certificates are
    signed by the new one, with no restart."""

    def cert_manager_secret() -> dict[str, Any]:
        files = {"tls.crt": test_ca.issuer_dir / wellknown.ISSUER_CERT_KEY,
                 "tls.key": test_ca.issuer_dir / wellknown.ISSUER_KEY_KEY,
                 "ca.crt": test_ca.anchors_path}  # fmt: skip
        return {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": wellknown.ISSUER_SECRET, "namespace": "meshlet"},
            "data": {k: base64.b64encode(f.read_bytes()).decode() for k, f in files.items()},
        }  # fmt: skip

    kube.apply(cert_manager_secret())
    kube.apply(_issuer_objects(test_ca)[1])  # the trust roots ConfigMap
    anchors = test_ca.anchors_path.read_bytes()
    with client.ApiClient(kube.client_configuration()) as api_client:
        srv = IdentityServer(
            IdentityConfig(
                addr=HostPort("127.0.0.1", 0), admin_addr=HostPort("127.0.0.1", 0),
                trust_anchors=None, issuer_dir=None, tokens_file=None, kube_api=api_client,
                reload_interval=0.1, issuer_scheme=wellknown.ISSUER_SCHEME_KUBERNETES,
            )
        )  # fmt: skip
        await srv.start()
        try:
            first = await certify(srv, anchors, b"tok-web", tmp_path / "first")
            current = (test_ca.issuer_dir / wellknown.ISSUER_CERT_KEY).read_bytes()
            current_der = x509.load_pem_x509_certificate(current).public_bytes(
                serialization.Encoding.DER
            )
            assert list(first.intermediate_certificates) == [current_der]
            renewed = test_ca.rotate_issuer().public_bytes(serialization.Encoding.DER)
            kube.apply(cert_manager_secret())
            for attempt in range(50):
                response = await certify(srv, anchors, b"tok-web", tmp_path / str(attempt))
                if list(response.intermediate_certificates) == [renewed]:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the renewed issuer in the cert-manager Secret was never used")
        finally:
            await srv.stop(grace=0)
