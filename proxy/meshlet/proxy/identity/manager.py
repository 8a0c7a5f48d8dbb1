"""The proxy's identity manager: obtains, checks, renews and serves its mTLS certificate.

Use from the app::

    settings = config.identity                # None: identity not configured (no mTLS)
    identity = IdentityManager(settings, metrics)
    identity.on_change(pool.drop_idle)        # after each new certificate
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(identity.run())     # cancel to stop
        ...
        if identity.ready:                    # /ready waits for this
            ctx = identity.server_context()   # the same object until the certificate changes

API:

- `IdentityManager(settings, metrics, *, clock=time.time, rng=None, sleep=asyncio.sleep)`;
  `clock`, `rng` and `sleep` are injected so tests can step through renewals.
- `local_name`: our identity; `ready`: a verified certificate has been installed (it stays true
  while renewals fail: the last certificate keeps serving); `expires_at`: its expiry or None.
- `run()`: makes the key and CSR in a child process (`identity.prestart`: this process never
  imports `cryptography`), then certifies and renews forever. It raises `PrestartFailed` only
  when no key can be made; every identity-service failure is logged, counted and retried.
- `server_context()` / `client_context()`: TLS 1.3, our chain and key, the trust anchors, ALPN
  `transport.l5d.io/v1`; the server verifies a client certificate when one is sent
  (CERT_OPTIONAL); the client verifies the server by name (pass `server_hostname`). Built once
  per certificate; `NoCertificate` before the first one.
- `on_change(callback)`: `callback()` runs after each new certificate is installed, and after
  new trust anchors (`anchors`, a followed `identity.anchors.TrustAnchors`) rebuilt the
  contexts, so holders of contexts (connection pools) can drop the old ones. A certificate
  that does not chain to new anchors is renewed at once.

Each round: read the token file (Kubernetes rotates it), `Certify` with the same CSR, write the
chain into a staging folder, check it (`identity.verify`: chain to the anchors, our name, our
key, valid now), and only then move it over `chain.pem` (atomic rename) and build new contexts.
A failed round keeps the current certificate. Timing (`core.refresh`): renew at 70 % of the
remaining lifetime (10 s to 24 h); after a failure retry with jittered backoff from 0.5 s up to
10 s, measured from the start of the failed attempt. Metrics: `identity_cert_expiration_timestamp_
seconds`, `identity_cert_refresh_timestamp_seconds`, `identity_cert_refresh_total{result}`.

Files: key (mode 0600), CSR and chain live in `settings.directory`, which should be
memory-backed; without one, a private folder under /dev/shm is made and removed by `run()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import re
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshlet.api import wellknown
from meshlet.api.cancellation import OwnCancellation
from meshlet.proxy.config import IdentitySettings
from meshlet.proxy.core import refresh
from meshlet.proxy.identity import prestart
from meshlet.proxy.identity.anchors import TrustAnchors
from meshlet.proxy.identity.certify import Certificate, CertifyClient, CertifyFailed
from meshlet.proxy.identity.verify import Rejected, verify
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.tls import contexts

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

CERTIFY_TIMEOUT: Final = 10.0
PRESTART_TIMEOUT: Final = 30.0
STAGING_DIR: Final = "staging"  # candidate chains, inside the identity directory
_SHM: Final = Path("/dev/shm")
# gRPC statuses that say the service could not answer (vs. refused our request).
_TRANSIENT: Final = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL", "RESOURCE_EXHAUSTED"}
)


@contextlib.contextmanager
def private_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new directory only this user can enter, under `parent`, removed with its files at the
    end; named `<prefix><pid>-<random>` so that the directories of processes that ended
    without removing theirs (killed: SIGKILL, the OOM killer) are found and removed by the next
    one, first (they hold private keys). (tempfile.TemporaryDirectory does this, but it imports
    shutil and with it bz2 and lzma: 0.4 MiB of the running proxy, for one directory of
    files.)"""
    remove_orphans(parent, prefix)
    while True:
        path = parent / f"{prefix}{os.getpid()}-{os.urandom(6).hex()}"
        try:
            path.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    try:
        yield path
    finally:
        _remove_tree(path)


def remove_orphans(parent: Path, prefix: str) -> list[Path]:
    """Removes this user's `<prefix><pid>-<random>` directories under `parent` whose process
    no longer runs; those removed. A directory whose pid runs again (another process took the
    number) is left: a conservative miss, never another process's files."""
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)-[0-9a-f]{12}")
    removed: list[Path] = []
    uid = os.geteuid()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or _runs(int(found.group(1))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_dir(
                follow_symlinks=False
            ):
                continue
        except OSError:
            continue
        _remove_tree(Path(entry.path))
        removed.append(Path(entry.path))
    return removed


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def _remove_tree(path: Path) -> None:
    with contextlib.suppress(OSError):
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                inner = os.path.join(root, name)
                if os.path.islink(inner):
                    os.unlink(inner)
                else:
                    os.rmdir(inner)
        path.rmdir()


class NoCertificate(RuntimeError):
    """Contexts were asked for before the first certificate was obtained."""


class PrestartFailed(RuntimeError):
    """The child process that makes the key and CSR failed; the proxy cannot have an identity."""


class RefreshResult(enum.Enum):
    """The `result` label of `identity_cert_refresh_total` (a closed set)."""

    OK = "ok"
    UNAVAILABLE = "unavailable"  # the identity service could not be reached or could not answer
    REFUSED = "refused"  # it answered with an error status
    REJECTED = "rejected"  # it returned a certificate that failed our checks
    LOCAL_ERROR = "local_error"  # the token file or identity directory could not be used


@dataclass(frozen=True, slots=True)
class _Installed:
    """A verified certificate and the contexts built from it."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    control: ssl.SSLContext  # the control port's gRPC (tap): a client certificate required, h2
    direct: ssl.SSLContext  # TLS for us on an app's port: h2 or HTTP/1.1, a client cert optional
    expires_at: float


class IdentityManager:
    def __init__(
        self,
        settings: IdentitySettings,
        metrics: ProxyMetrics,
        *,
        clock: Clock = time.time,
        rng: random.Random | None = None,
        sleep: Sleep = asyncio.sleep,
        anchors: TrustAnchors | None = None,
    ) -> None:
        self.local_name = settings.local_name
        self._settings = settings
        self.anchors = anchors or TrustAnchors(settings.trust_anchors_pem)
        self.anchors.on_change(self._anchors_changed)
        self._renew_now = asyncio.Event()
        self._published: tuple[Path, Path] | None = None  # the chain and key in use
        self._metrics = metrics
        self._clock = clock
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._installed: _Installed | None = None
        self._callbacks: list[Callable[[], None]] = []

    @property
    def ready(self) -> bool:
        """A verified certificate is installed."""
        return self._installed is not None

    @property
    def expires_at(self) -> float | None:
        return None if self._installed is None else self._installed.expires_at

    def server_context(self) -> ssl.SSLContext:
        return self._current().server

    def client_context(self) -> ssl.SSLContext:
        return self._current().client

    def control_context(self) -> ssl.SSLContext:
        """For the control port's gRPC server: our certificate; a client's required and
        verified (a client without one fails the handshake)."""
        return self._current().control

    def direct_context(self) -> ssl.SSLContext:
        """For TLS addressed to our identity on one of the pod's own ports (a proxy calling a
        meshed controller: see mesh/inbound.py `accept_direct`)."""
        return self._current().direct

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def _current(self) -> _Installed:
        if self._installed is None:
            raise NoCertificate(
                f"no certificate for {self.local_name} yet: the identity service has not"
                " certified this proxy (see the identity_cert_refresh_total metric and the log)"
            )
        return self._installed

    # The loop

    async def run(self) -> None:
        """Pre-start in a child, then certify and renew until cancelled."""
        with self._workdir() as directory:
            files = await _prestart(directory, self.local_name)
            csr = _read_bytes(files.csr)
            failures = 0
            own = OwnCancellation()
            while True:
                started = self._clock()
                result = await self._refresh(directory, files, csr)
                self._metrics.identity_cert_refresh_total.labels(result.value).inc()
                if result is RefreshResult.OK:
                    failures = 0
                    delay = refresh.renew_in(self._current().expires_at, self._clock())
                    log.info("identity: next renewal in %.0fs", delay)
                else:
                    own.check()  # a failure made of our own cancellation is not retried
                    failures += 1
                    elapsed = self._clock() - started
                    delay = max(0.0, refresh.retry_in(failures, self._rng) - elapsed)
                await self._wait(delay)

    async def _wait(self, delay: float) -> None:
        """Sleeps `delay`, or less when new trust anchors call for a renewal now."""
        if self._renew_now.is_set():
            self._renew_now.clear()
            return
        sleeping = asyncio.ensure_future(self._sleep(delay))
        woken = asyncio.ensure_future(self._renew_now.wait())
        try:
            await asyncio.wait({sleeping, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeping, woken):
                task.cancel()
            await asyncio.gather(sleeping, woken, return_exceptions=True)
        self._renew_now.clear()

    def _anchors_changed(self) -> None:
        """New trust anchors: peers are verified against them from now on (the contexts are
        built again and their holders told), and a certificate that does not chain to them is
        renewed at once rather than at its time."""
        if self._installed is None or self._published is None:
            return
        chain, key = self._published
        try:
            verify(chain, key, self.anchors.pem, self.local_name, self._clock())
        except Rejected as exc:
            log.warning("identity: the certificate does not chain to the new trust anchors (%s);"
                        " renewing it now", exc.reason)  # fmt: skip
            self._renew_now.set()
        try:
            self._installed = self._contexts(chain, key, self._installed.expires_at)
        except (OSError, ssl.SSLError) as exc:
            log.error("identity: cannot build contexts on the new trust anchors: %s", exc)
            return
        self._changed()

    @contextlib.contextmanager
    def _workdir(self) -> Iterator[Path]:
        if self._settings.directory is not None:
            yield self._settings.directory
            return
        parent = _SHM if _SHM.is_dir() else Path(os.environ.get("TMPDIR") or "/tmp")
        with private_dir(parent, "meshlet-identity-") as path:  # memory-backed where it can
            yield path

    async def _refresh(
        self, directory: Path, files: prestart.IdentityFiles, csr: bytes
    ) -> RefreshResult:
        settings = self._settings
        try:
            token = _read_token(settings.token_file)
        except (OSError, ValueError) as exc:
            log.warning(
                "identity: cannot use the token file %s (%s); check the service-account token"
                " volume and %s",
                settings.token_file, exc, wellknown.ProxyEnv.IDENTITY_TOKEN_FILE,
            )  # fmt: skip
            return RefreshResult.LOCAL_ERROR
        try:
            certificate = await self._certify(token, csr)
        except CertifyFailed as exc:
            return self._certify_failed(exc)
        try:
            installed = self._install(directory, files, certificate)
        except Rejected as exc:
            log.error(
                "identity: rejected the certificate from the identity service: %s; %s",
                exc.reason, self._keeping(),
            )  # fmt: skip
            return RefreshResult.REJECTED
        except (OSError, ssl.SSLError) as exc:
            log.error("identity: cannot install the certificate in %s: %s", directory, exc)
            return RefreshResult.LOCAL_ERROR
        self._installed = installed
        self._published = (directory / contexts.CHAIN_FILE, files.key)
        now = self._clock()
        self._metrics.identity_cert_expiration_timestamp_seconds.set(installed.expires_at)
        self._metrics.identity_cert_refresh_timestamp_seconds.set(now)
        log.info(
            "identity: certified as %s, valid for %.0fs",
            self.local_name,
            installed.expires_at - now,
        )
        self._changed()
        return RefreshResult.OK

    def _changed(self) -> None:
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("identity: a certificate-change callback failed")

    async def _certify(self, token: bytes, csr: bytes) -> Certificate:
        settings = self._settings
        host, port = settings.svc_addr
        try:
            client = CertifyClient(
                host, port, settings.svc_name, self.anchors.pem, timeout=CERTIFY_TIMEOUT
            )
        except ssl.SSLError as exc:
            raise CertifyFailed("UNAVAILABLE", f"bad trust anchors: {exc}") from exc
        try:
            return await client.certify(self.local_name, token, csr)
        except CertifyFailed:
            raise
        except Exception as exc:  # e.g. an HTTP/2 protocol error: retried like an outage
            raise CertifyFailed("UNKNOWN", f"unexpected error from the client: {exc!r}") from exc
        finally:
            client.close()

    def _certify_failed(self, exc: CertifyFailed) -> RefreshResult:
        if exc.status in _TRANSIENT:
            log.warning(
                "identity: the identity service at %s is unavailable (%s); %s",
                self._settings.svc_addr, exc, self._keeping(),
            )  # fmt: skip
            return RefreshResult.UNAVAILABLE
        log.warning(
            "identity: the identity service refused to certify %s (%s); check that the token in"
            " %s belongs to the service account named by %s; %s",
            self.local_name, exc, self._settings.token_file, wellknown.ProxyEnv.IDENTITY_LOCAL_NAME,
            self._keeping(),
        )  # fmt: skip
        return RefreshResult.REFUSED

    def _keeping(self) -> str:
        if self._installed is None:
            return "no certificate yet, retrying"
        return "keeping the current certificate, retrying"

    def _install(
        self, directory: Path, files: prestart.IdentityFiles, certificate: Certificate
    ) -> _Installed:
        """Stages, verifies, then atomically publishes the chain; contexts from it."""
        anchors = self.anchors.pem
        staging = directory / STAGING_DIR
        staging.mkdir(mode=0o700, exist_ok=True)
        candidate = contexts.write_chain(
            staging, certificate.leaf_der, certificate.intermediates_der
        )
        try:
            validity = verify(candidate, files.key, anchors, self.local_name, self._clock())
        except Rejected:
            candidate.unlink(missing_ok=True)
            raise
        chain = directory / contexts.CHAIN_FILE
        os.replace(candidate, chain)
        return self._contexts(chain, files.key, min(validity.not_after, certificate.valid_until))

    def _contexts(self, chain: Path, key: Path, expires_at: float) -> _Installed:
        anchors = self.anchors.pem
        return _Installed(
            server=contexts.server_context(chain, key, anchors, require_client_cert=False),
            client=contexts.client_context(chain, key, anchors),
            control=contexts.control_server_context(chain, key, anchors),
            direct=contexts.direct_server_context(chain, key, anchors),
            expires_at=expires_at,
        )


def _read_bytes(path: Path) -> bytes:
    return path.read_bytes()


def _read_token(path: Path) -> bytes:
    """The token as it is now (read at each request: Kubernetes rotates it)."""
    token = path.read_bytes().strip()
    if not token:
        raise ValueError("the file is empty")
    return token


async def _prestart(directory: Path, name: str) -> prestart.IdentityFiles:
    """`prestart` in a child process (as `prestart.prepare_in_child`, but awaitable and killed
    when cancelled), so that `cryptography` is never imported here."""
    argv = ["-m", prestart.__name__, "--dir", str(directory), "--name", name]
    process = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(PRESTART_TIMEOUT):
            _, stderr = await process.communicate()
    except TimeoutError as exc:
        raise PrestartFailed(
            f"making the identity key and CSR took more than {PRESTART_TIMEOUT:.0f}s"
        ) from exc
    finally:
        if process.returncode is None:  # timed out or cancelled
            process.kill()
            await process.wait()
    if process.returncode != 0:
        detail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise PrestartFailed(
            f"making the identity key and CSR in {directory} failed (exit {process.returncode}:"
            f" {detail[0]}); check that the directory is writable by the proxy"
        )
    return prestart.files_in(directory)
