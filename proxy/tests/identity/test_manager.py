"""The identity manager against the real identity service (TLS gRPC on 127.0.0.1, a real CA).

Renewals are stepped through with an injected sleep (`Stepper`) that moves an injected clock by
the delay the manager asked for, so a day of certificate lifetime passes in milliseconds while
every Certify, handshake and file write is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.identity import ca
from meshlet.controlplane.identity.server import IdentityConfig, IdentityServer
from meshlet.proxy.config import IdentitySettings
from meshlet.proxy.core import refresh
from meshlet.proxy.identity.anchors import TrustAnchors
from meshlet.proxy.identity.manager import (
    IdentityManager,
    NoCertificate,
    PrestartFailed,
    private_dir,
)
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.tls import contexts
from meshlet_testing.leaks import open_sockets, sockets_closed
from meshlet_testing.sockets import free_port

WEB = wellknown.identity_name("web", "emojivoto")
EMOJI = wellknown.identity_name("emoji", "emojivoto")
TOKENS = """
tok-web: {namespace: emojivoto, serviceaccount: web}
tok-emoji: {namespace: emojivoto, serviceaccount: emoji}
"""
DAY = dt.timedelta(days=1)
LIFETIME = wellknown.LEAF_LIFETIME_SECONDS + wellknown.CLOCK_SKEW_SECONDS


@dataclass
class IdentityService:
    """The control plane's identity service on a fixed 127.0.0.1 port, started and stopped by
    the test; `skew` shifts the clock it signs with (to make it return bad certificates)."""

    test_ca: Any
    tokens: Path
    port: int = field(default_factory=free_port)
    skew: dt.timedelta = dt.timedelta()
    server: IdentityServer | None = None

    def _clock(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC) + self.skew

    async def start(self) -> None:
        config = IdentityConfig(
            addr=HostPort("127.0.0.1", self.port),
            admin_addr=HostPort("127.0.0.1", 0),
            trust_anchors=self.test_ca.anchors_path,
            issuer_dir=self.test_ca.issuer_dir,
            tokens_file=self.tokens,
            kube_api=None,
            reload_interval=0.1,
        )
        self.server = IdentityServer(config, clock=self._clock)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0)
            self.server = None


@pytest.fixture
async def identity(test_ca: Any, tmp_path: Path) -> AsyncIterator[IdentityService]:
    """Not started: tests call `await identity.start()`. At the end the managers' TLS
    connections to it finish closing before the loop does (on a busy machine the server's
    close_notify came as the loop closed: an unclosed transport)."""
    sockets = open_sockets()
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(TOKENS)
    service = IdentityService(test_ca, tokens)
    yield service
    await service.stop()
    await sockets_closed(sockets, [("127.0.0.1", service.port)])


def settings(service: IdentityService, tmp_path: Path, sa: str, token: str) -> IdentitySettings:
    token_file = tmp_path / f"{sa}.token"
    token_file.write_text(token)
    return IdentitySettings(
        local_name=wellknown.identity_name(sa, "emojivoto"),
        svc_addr=HostPort("127.0.0.1", service.port),
        svc_name=wellknown.IDENTITY_SERVICE_NAME,
        token_file=token_file,
        trust_anchors_pem=service.test_ca.anchors_pem,
        directory=tmp_path / f"{sa}-identity",
    )


@asynccontextmanager
async def running(*managers: IdentityManager) -> AsyncIterator[None]:
    """Runs the managers for the duration of the block, then cancels them."""
    async with asyncio.TaskGroup() as tasks:
        runs = [tasks.create_task(m.run()) for m in managers]
        yield
        for run in runs:
            run.cancel()


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Polls `condition` every 10 ms; fails after `within` seconds."""
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"still false after {within}s")


def refreshes(metrics: ProxyMetrics, result: str) -> float:
    value = metrics.registry.get_sample_value("identity_cert_refresh_total", {"result": result})
    return value or 0.0


def gauge(metrics: ProxyMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


class FakeClock:
    """Real time plus an offset the test moves."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class Stepper:
    """An injected sleep that hands control to the test: `await next()` returns the delay the
    manager asked for; `wake()` moves the clock by that delay and lets the manager go on."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._asked: asyncio.Queue[tuple[float, asyncio.Future[None]]] = asyncio.Queue()
        self._current: tuple[float, asyncio.Future[None]] | None = None

    async def __call__(self, delay: float) -> None:
        done = asyncio.get_running_loop().create_future()
        await self._asked.put((delay, done))
        await done

    async def next(self) -> float:
        async with asyncio.timeout(10):
            self._current = await self._asked.get()
        return self._current[0]

    def wake(self) -> None:
        assert self._current is not None
        delay, done = self._current
        self.clock.offset += delay
        done.set_result(None)


# First certificate


async def test_first_certificate_makes_both_proxies_ready_for_mutual_tls13(
    identity: IdentityService, tmp_path: Path
) -> None:
    await identity.start()
    web_metrics, emoji_metrics = ProxyMetrics(), ProxyMetrics()
    web = IdentityManager(settings(identity, tmp_path, "web", "tok-web"), web_metrics)
    emoji = IdentityManager(settings(identity, tmp_path, "emoji", "tok-emoji\n"), emoji_metrics)
    assert not web.ready
    with pytest.raises(NoCertificate, match="no certificate for web"):
        web.server_context()
    changes: list[str] = []
    web.on_change(lambda: changes.append("web"))

    async with running(web, emoji):
        await eventually(lambda: web.ready and emoji.ready)
        now = time.time()
        assert changes == ["web"]
        assert refreshes(web_metrics, "ok") == 1
        expiry = gauge(web_metrics, "identity_cert_expiration_timestamp_seconds")
        assert expiry == pytest.approx(now + LIFETIME, abs=5)
        assert web.expires_at == expiry
        refreshed = gauge(web_metrics, "identity_cert_refresh_timestamp_seconds")
        assert refreshed == pytest.approx(now, abs=5)
        for name in ("key.pem", "chain.pem"):
            assert (tmp_path / "web-identity" / name).stat().st_mode & 0o777 == 0o600
        assert not list((tmp_path / "web-identity" / "staging").iterdir())
        # Built once per certificate, not per connection.
        assert web.client_context() is web.client_context()
        assert emoji.server_context() is emoji.server_context()

        seen: dict[str, Any] = {}
        served = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen["client"] = contexts.peer_identity(writer.get_extra_info("ssl_object"))
            writer.write(await reader.readexactly(4))
            await writer.drain()
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()
            served.set()

        listener = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=emoji.server_context())
        async with listener:
            port = listener.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=web.client_context(), server_hostname=EMOJI
            )
            tls = writer.get_extra_info("ssl_object")
            assert tls.version() == "TLSv1.3"
            assert tls.selected_alpn_protocol() == wellknown.TRANSPORT_ALPN
            assert contexts.peer_identity(tls) == EMOJI
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            writer.close()
            await writer.wait_closed()
            # the server's side closed too: the loop never ends with a transport open
            await asyncio.wait_for(served.wait(), 10)
        assert seen["client"] == WEB

        # The client context verifies the server by name: web is not emoji. (The server is a
        # thread with a blocking socket: the side of a refused handshake is closed when the
        # test's loop ends, whatever the machine's pace.)
        with socket.create_server(("127.0.0.1", 0)) as plain:
            port = plain.getsockname()[1]

            def accept_one() -> None:
                conn, _ = plain.accept()
                with (
                    contextlib.suppress(OSError),
                    web.server_context().wrap_socket(conn, server_side=True) as tls_conn,
                ):
                    tls_conn.recv(1)
                conn.close()

            server = threading.Thread(target=accept_one)
            server.start()
            with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
                await asyncio.open_connection(
                    "127.0.0.1", port, ssl=emoji.client_context(), server_hostname=EMOJI
                )
            await asyncio.to_thread(server.join, 10)
            assert not server.is_alive()


SHM = Path("/dev/shm")


def shm_folders() -> set[Path]:
    return set(SHM.glob("meshlet-identity-*"))


def holds_chain_from(folder: Path, issuer: Any) -> bool:
    """Whether `folder` holds a chain issued by `issuer`: a folder of this test's, not of a
    proxy that another program on the machine runs at the same time."""
    try:
        chain = (folder / contexts.CHAIN_FILE).read_text()
    except OSError:
        return False
    return ssl.DER_cert_to_PEM_cert(issuer.public_bytes(Encoding.DER)) in chain


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")
async def test_without_a_directory_the_key_lives_in_a_private_memory_folder_removed_at_exit(
    identity: IdentityService, tmp_path: Path
) -> None:
    await identity.start()
    before = shm_folders()
    configured = replace(settings(identity, tmp_path, "web", "tok-web"), directory=None)
    manager = IdentityManager(configured, ProxyMetrics())
    async with running(manager):
        await eventually(lambda: manager.ready)
        issuer = identity.test_ca.issuer
        (folder,) = [f for f in shm_folders() - before if holds_chain_from(f, issuer)]
        assert folder.stat().st_mode & 0o777 == 0o700
        assert (folder / "key.pem").stat().st_mode & 0o777 == 0o600
        assert (folder / "chain.pem").exists()
    assert not folder.exists()
    assert manager.ready  # the loaded contexts outlive the files


def test_a_killed_process_s_private_folder_is_removed_by_the_next_and_no_other(
    tmp_path: Path,
) -> None:
    """A process killed with SIGKILL cannot remove its folder (and the key in it); the next
    private folder made under the same parent removes it, and leaves a running process's
    folder, another user's, and folders of other names alone."""
    code = (
        "import sys, time; from pathlib import Path;"
        " from meshlet.proxy.identity.manager import private_dir\n"
        "with private_dir(Path(sys.argv[1]), 'meshlet-identity-') as d:\n"
        "    (d / 'key.pem').write_text('secret'); print(d.name, flush=True); time.sleep(60)"
    )

    def holder() -> tuple[subprocess.Popen[str], Path]:
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        return proc, tmp_path / proc.stdout.readline().strip()

    killed, killed_dir = holder()
    running_proc, running_dir = holder()
    try:
        killed.kill()
        killed.communicate(timeout=10)
        assert (killed_dir / "key.pem").exists()  # what SIGKILL leaves
        others = [tmp_path / "meshlet-identity-0a1b2c3d4e5f", tmp_path / "unrelated-1-0a1b2c3d4e5f"]
        for folder in others:
            folder.mkdir()
        foreign = tmp_path / f"meshlet-identity-{killed.pid}-0a1b2c3d4e5f"
        foreign.mkdir()
        if os.geteuid() == 0:
            os.chown(foreign, 65534, 65534)  # another user's (nobody's): never touched
        with private_dir(tmp_path, "meshlet-identity-") as ours:
            assert not killed_dir.exists()
            assert (running_dir / "key.pem").exists()
            assert all(folder.exists() for folder in others)
            assert foreign.exists() == (os.geteuid() == 0)
            assert ours.name.startswith(f"meshlet-identity-{os.getpid()}-")
        assert not ours.exists()
    finally:
        for proc in (killed, running_proc):
            proc.kill()
            proc.communicate(timeout=10)


# Identity down, bad answers, rotated tokens


async def test_identity_down_at_start_retries_with_backoff_then_recovers(
    identity: IdentityService, tmp_path: Path
) -> None:
    """Not ready while the service is down; retries at growing, jittered delays of at most
    10 s (slept 20 times faster here); ready as soon as the service is up."""
    asked: list[float] = []

    async def fast_sleep(delay: float) -> None:
        asked.append(delay)
        await asyncio.sleep(delay / 20)

    metrics = ProxyMetrics()
    manager = IdentityManager(
        settings(identity, tmp_path, "web", "tok-web"),
        metrics,
        rng=random.Random(7),
        sleep=fast_sleep,
    )
    async with running(manager):
        await eventually(lambda: refreshes(metrics, "unavailable") >= 7)
        assert not manager.ready
        with pytest.raises(NoCertificate):
            manager.client_context()
        assert gauge(metrics, "identity_cert_expiration_timestamp_seconds") == 0
        for failures, delay in enumerate(asked, start=1):
            ceiling = refresh.retry_ceiling(failures)
            assert ceiling / 2 <= delay <= ceiling <= 10
        assert refresh.retry_ceiling(len(asked)) == 10  # the backoff reached its cap

        await identity.start()
        await eventually(lambda: manager.ready)
    assert refreshes(metrics, "ok") == 1
    assert refreshes(metrics, "unavailable") >= 7


async def test_identity_down_during_renewal_keeps_the_certificate_and_retries_within_10s(
    identity: IdentityService, tmp_path: Path
) -> None:
    await identity.start()
    clock = FakeClock()
    stepper = Stepper(clock)
    metrics = ProxyMetrics()
    manager = IdentityManager(
        settings(identity, tmp_path, "web", "tok-web"), metrics, clock=clock, sleep=stepper
    )
    changes: list[float | None] = []
    manager.on_change(lambda: changes.append(manager.expires_at))

    async with running(manager):
        first = await stepper.next()
        assert manager.ready
        expiry = manager.expires_at
        assert expiry is not None
        assert first == pytest.approx(0.7 * (expiry - clock()), abs=1)
        assert first == pytest.approx(0.7 * LIFETIME, abs=5)  # ~16.8 h
        server_ctx, client_ctx = manager.server_context(), manager.client_context()

        await identity.stop()
        retries = []
        for _ in range(7):
            stepper.wake()
            retries.append(await stepper.next())
            assert manager.ready
            assert manager.server_context() is server_ctx
            assert manager.client_context() is client_ctx
        assert all(0 < delay <= 10 for delay in retries)
        assert retries[-1] > 5  # backed off towards the cap
        assert refreshes(metrics, "unavailable") == 7
        assert gauge(metrics, "identity_cert_expiration_timestamp_seconds") == expiry

        await identity.start()  # same port
        stepper.wake()
        renewal = await stepper.next()
        assert manager.server_context() is not server_ctx
        assert manager.client_context() is not client_ctx
        renewed = manager.expires_at
        assert renewed is not None and renewed >= expiry
        # The new leaf was issued at real time; our clock is ~16.8 h ahead: 70 % of what is left.
        assert renewal == pytest.approx(0.7 * (renewed - clock()), abs=1)
        assert renewal < 0.7 * 8 * 3600

        await identity.stop()  # a new failure after a success starts the backoff afresh
        stepper.wake()
        assert await stepper.next() <= refresh.FIRST_RETRY
    assert changes == [expiry, renewed]
    assert refreshes(metrics, "ok") == 2
    assert refreshes(metrics, "unavailable") == 8
    assert gauge(metrics, "identity_cert_expiration_timestamp_seconds") == renewed


async def test_an_expired_or_not_yet_valid_certificate_is_rejected_and_the_old_one_kept(
    identity: IdentityService, test_ca: Any, tmp_path: Path
) -> None:
    # An issuer valid since three days ago lets the service sign with a clock in the past.
    test_ca.rotate_issuer(now=dt.datetime.now(dt.UTC) - 3 * DAY)
    await identity.start()
    clock = FakeClock()
    stepper = Stepper(clock)
    metrics = ProxyMetrics()
    manager = IdentityManager(
        settings(identity, tmp_path, "web", "tok-web"), metrics, clock=clock, sleep=stepper
    )
    chain = tmp_path / "web-identity" / "chain.pem"

    async with running(manager):
        await stepper.next()
        good_chain, server_ctx = chain.read_bytes(), manager.server_context()
        expiry = manager.expires_at

        for skew in (-2 * DAY, +DAY):  # expired; not yet valid
            identity.skew = skew
            stepper.wake()
            assert 0 < await stepper.next() <= 10
            assert manager.server_context() is server_ctx
            assert manager.expires_at == expiry
            assert chain.read_bytes() == good_chain  # only a verified chain is published
            assert not list((tmp_path / "web-identity" / "staging").iterdir())
        assert refreshes(metrics, "rejected") == 2

        identity.skew = dt.timedelta()
        stepper.wake()
        await stepper.next()
        assert manager.server_context() is not server_ctx
        assert chain.read_bytes() != good_chain
    assert refreshes(metrics, "ok") == 2


async def test_the_token_file_is_read_at_each_request(
    identity: IdentityService, tmp_path: Path
) -> None:
    """Kubernetes rotates projected tokens: a missing, then stale, then valid token."""
    await identity.start()
    clock = FakeClock()
    stepper = Stepper(clock)
    metrics = ProxyMetrics()
    configured = settings(identity, tmp_path, "web", "")
    configured.token_file.unlink()
    manager = IdentityManager(configured, metrics, clock=clock, sleep=stepper)

    async with running(manager):
        assert await stepper.next() <= 10
        assert refreshes(metrics, "local_error") == 1

        configured.token_file.write_text("tok-stale")
        stepper.wake()
        assert await stepper.next() <= 10
        assert refreshes(metrics, "refused") == 1  # FAILED_PRECONDITION: unknown token
        assert not manager.ready

        configured.token_file.write_text("tok-web")
        stepper.wake()
        assert await stepper.next() > 10 * 3600
        assert manager.ready
    assert refreshes(metrics, "ok") == 1


async def test_a_key_that_cannot_be_made_stops_the_manager_with_a_clear_error(
    identity: IdentityService, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    configured = replace(settings(identity, tmp_path, "web", "tok-web"), directory=blocker / "id")
    manager = IdentityManager(configured, ProxyMetrics())
    with pytest.raises(PrestartFailed, match="check that the directory is writable"):
        await manager.run()
    assert not manager.ready


# The proxy process stays free of cryptography

CHILD = """
import asyncio, json, sys
from pathlib import Path
import uvloop
from meshlet.api.hostport import HostPort
from meshlet.proxy.config import IdentitySettings
from meshlet.proxy.identity.manager import IdentityManager
from meshlet.proxy.metrics import ProxyMetrics

async def main() -> None:
    args = json.loads(sys.argv[1])
    settings = IdentitySettings(
        local_name=args["name"], svc_addr=HostPort("127.0.0.1", args["port"]), svc_name=args["svc"],
        token_file=Path(args["token"]), trust_anchors_pem=args["anchors"], directory=None,
    )
    manager = IdentityManager(settings, ProxyMetrics())
    async with asyncio.TaskGroup() as tasks:
        run = tasks.create_task(manager.run())
        while not manager.ready:
            await asyncio.sleep(0.01)
        run.cancel()
    modules = sorted(m for m in sys.modules if m.split(".")[0] in ("cryptography", "grpc"))
    print(json.dumps({"ready": manager.ready, "modules": modules}))

uvloop.run(main())
"""


async def test_the_proxy_process_never_imports_cryptography(
    identity: IdentityService, tmp_path: Path
) -> None:
    """DESIGN §5 memory budget: the key and CSR are made in a child; the proxy needs only ssl
    (and grpclib, not grpcio)."""
    await identity.start()
    configured = settings(identity, tmp_path, "web", "tok-web")
    args = {
        "name": configured.local_name,
        "port": identity.port,
        "svc": configured.svc_name,
        "token": str(configured.token_file),
        "anchors": configured.trust_anchors_pem,
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, json.dumps(args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(15):
            out, err = await child.communicate()
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 0, err.decode()
    report = json.loads(out)
    assert report == {"ready": True, "modules": []}


# Settings


# Trust-anchor rotation


async def echo(server: ssl.SSLContext, client: ssl.SSLContext) -> str | None:
    """One TLS exchange from `client` to a server on `server` (as emoji): the identity the
    server saw, after the bytes came back."""
    seen: list[str | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(contexts.peer_identity(writer.get_extra_info("ssl_object")))
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            writer.write(await reader.readexactly(4))
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server)
    async with listener:
        port = listener.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname=EMOJI
        )
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        writer.close()
        await writer.wait_closed()
    return seen[0] if seen else None


def followed(service: IdentityService, tmp_path: Path, sa: str, token: str) -> IdentitySettings:
    """Settings whose trust anchors are followed in a file of the proxy's own (its pod's
    ConfigMap volume), written with the anchors in force."""
    path = tmp_path / f"{sa}-anchors" / "ca-bundle.crt"
    path.parent.mkdir()
    path.write_text(service.test_ca.anchors_pem)
    return replace(settings(service, tmp_path, sa, token), trust_anchors_file=path)


def anchors_of(settings: IdentitySettings) -> TrustAnchors:
    return TrustAnchors(settings.trust_anchors_pem, settings.trust_anchors_file)


async def test_a_trust_anchor_rotation_keeps_every_exchange_and_shuts_out_the_old_anchor(
    identity: IdentityService, tmp_path: Path
) -> None:
    """docs/identity.md's procedure, between two proxies' managers, with an exchange at every
    step: add the new anchor to the bundle, issue from an issuer signed by it (the proxies
    renew at their time: here the test wakes them), remove the old anchor. No exchange fails
    and no step restarts a manager; at the end a peer trusting only the old anchor, with a
    certificate from the old issuer, is refused."""
    await identity.start()
    test_ca = identity.test_ca
    old, old_pem = test_ca.anchor, test_ca.anchors_pem
    # a clock each: a wake moves the clock of the manager it wakes by its ~17 h
    steppers = {sa: Stepper(FakeClock()) for sa in ("web", "emoji")}
    config = {sa: followed(identity, tmp_path, sa, f"tok-{sa}") for sa in steppers}
    managers = {}
    for sa, stepper in steppers.items():
        managers[sa] = IdentityManager(config[sa], ProxyMetrics(), clock=stepper.clock,
                                       sleep=stepper, anchors=anchors_of(config[sa]))  # fmt: skip
    web, emoji = managers["web"], managers["emoji"]
    changes: list[str] = []
    web.on_change(lambda: changes.append("web"))

    def write_bundle(*anchors: Any) -> None:
        for sa, manager in managers.items():
            path = config[sa].trust_anchors_file
            assert path is not None
            path.write_bytes(ca.cert_pem(*anchors))
            assert manager.anchors.check()

    async with running(web, emoji):
        for stepper in steppers.values():
            await stepper.next()
        assert await echo(emoji.server_context(), web.client_context()) == WEB
        old_chain = (tmp_path / "web-identity" / contexts.CHAIN_FILE).read_bytes()
        (tmp_path / "old-chain.pem").write_bytes(old_chain)

        # 1. the new anchor beside the old: contexts rebuilt on both, nobody renews
        new, new_key = test_ca.new_anchor()
        test_ca.write_anchors(old, new)
        write_bundle(old, new)
        assert changes == ["web", "web"] and web.anchors.count == 2
        assert await echo(emoji.server_context(), web.client_context()) == WEB

        # 2. an issuer signed by the new anchor; each proxy renews at its time, one at a time,
        # so old and new leaves meet, and each side trusts both
        test_ca.issue_from(new, new_key)
        await asyncio.sleep(0.5)  # the identity service reads its issuer every 0.1 s here
        for sa, stepper in steppers.items():
            stepper.wake()
            await stepper.next()
            assert holds_chain_from(tmp_path / f"{sa}-identity", test_ca.issuer), sa
            assert await echo(emoji.server_context(), web.client_context()) == WEB

        # 3. the old anchor removed: every leaf chains to the new one, nobody renews
        test_ca.write_anchors(new)
        write_bundle(new)
        assert await echo(emoji.server_context(), web.client_context()) == WEB
        assert all(m.anchors.count == 1 for m in managers.values())

        # a proxy left on the old anchor, with its old certificate, gets nowhere
        key = tmp_path / "web-identity" / "key.pem"
        stale = contexts.client_context(tmp_path / "old-chain.pem", key, old_pem)
        with pytest.raises(ssl.SSLCertVerificationError):
            await echo(emoji.server_context(), stale)
        current = contexts.client_context(tmp_path / "old-chain.pem", key, test_ca.anchors_pem)
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await echo(emoji.server_context(), current)  # its old leaf is refused by emoji


async def test_a_certificate_that_no_longer_chains_to_the_anchors_is_renewed_at_once(
    identity: IdentityService, tmp_path: Path
) -> None:
    """Anchors that drop the one the certificate chains to (a rotation whose last step came
    before this proxy renewed): the manager renews now, not in its ~17 h."""
    await identity.start()
    test_ca = identity.test_ca
    config = followed(identity, tmp_path, "web", "tok-web")
    metrics = ProxyMetrics()
    web = IdentityManager(config, metrics, anchors=anchors_of(config))
    async with running(web):
        await eventually(lambda: web.ready)
        new, new_key = test_ca.new_anchor()
        test_ca.issue_from(new, new_key)
        test_ca.write_anchors(test_ca.anchor, new)  # the identity service's own bundle
        await asyncio.sleep(0.5)
        assert config.trust_anchors_file is not None
        config.trust_anchors_file.write_bytes(ca.cert_pem(new))
        assert web.anchors.check()
        await eventually(lambda: refreshes(metrics, "ok") == 2)
        assert holds_chain_from(tmp_path / "web-identity", test_ca.issuer)
