"""Owns the Kubernetes API source: list then watch each kind, relist on 410, resync, reconnect.

The `kubernetes` client is synchronous, so each kind runs its list-then-watch loop in a worker
thread that `run` owns; events reach the sink on the event loop through
`call_soon_threadsafe`. Objects are plain JSON dicts exactly as the API server sends them
(`metadata.resourceVersion`, `status.podIP`), never client model objects. The decisions (what a
list or a watch event means, how long to back off, how long to watch) are plain functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

from kubernetes import client, watch

from meshlet.api.backoff import jittered
from meshlet.controlplane.k8s.events import (
    DESTINATION_KINDS,
    Delete,
    Event,
    Kind,
    Sink,
    Snapshot,
    Upsert,
)

logger = logging.getLogger(__name__)

OnEvent = Callable[[Kind, float], None]  # (kind, seconds the event waited for the event loop)
Lister = Callable[..., Any]  # a `list_*` method of the client, as `watch.Watch.stream` takes it

SHORT_WATCH_SECONDS = 1.0  # a watch ending sooner without any event counts as a failure
JOIN_SECONDS = 5.0  # how long cancelling `run` waits for its worker threads
_JOIN_POLL_SECONDS = 0.02


class ShortWatchError(Exception):
    """A watch ended cleanly but at once and without events: retried after a backoff, so a
    server or proxy that keeps doing so is not hammered."""


# -- decisions -------------------------------------------------------------------------------


def snapshot_of(kind: Kind, body: Mapping[str, Any]) -> tuple[Snapshot, str]:
    """A list response as the Snapshot it means, and the resourceVersion to watch from.

    The API server leaves `apiVersion` and `kind` out of the items of built-in lists; they are
    filled in so that listed objects look like watched ones."""
    items = body.get("items") or ()
    objects = tuple({"apiVersion": kind.api_version, "kind": kind.kind, **item} for item in items)
    return Snapshot(kind, objects), str(body["metadata"]["resourceVersion"])


def change_of(kind: Kind, event: Mapping[str, Any]) -> tuple[Event | None, str | None]:
    """A watch event as the change it means (None for a BOOKMARK) and the version it carries."""
    obj = event.get("raw_object")
    if not isinstance(obj, dict):
        return None, None
    metadata = obj.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    seen = str(version) if version else None
    match event.get("type"):
        case "ADDED" | "MODIFIED":
            return Upsert(kind, obj), seen
        case "DELETED":
            return Delete(kind, obj), seen
        case _:
            return None, seen


def backoff_delay(attempt: int, backoff: tuple[float, float], rng: random.Random) -> float:
    """The wait before retry `attempt` (0-based): `meshlet.api.backoff` from base to cap."""
    return jittered(attempt + 1, *backoff, rng)


def watch_seconds(watch_timeout: float, until_resync: float) -> int:
    """The server-side `timeoutSeconds` of the next watch: it ends by the next resync."""
    return max(1, math.ceil(min(watch_timeout, until_resync)))


def lister_for(api_client: Any, kind: Kind) -> Lister:
    """The cluster-wide list call of `kind`."""
    match kind:
        case Kind.SERVICE:
            return client.CoreV1Api(api_client).list_service_for_all_namespaces
        case Kind.POD:
            return client.CoreV1Api(api_client).list_pod_for_all_namespaces
        case Kind.ENDPOINT_SLICE:
            api = client.DiscoveryV1Api(api_client)
            return api.list_endpoint_slice_for_all_namespaces
        case Kind.NAMESPACE:
            return client.CoreV1Api(api_client).list_namespace
        case _:  # a custom resource (ServiceProfile, the policy kinds, Gateway API routes)
            group, version = kind.api_version.split("/")
            custom = client.CustomObjectsApi(api_client)
            return functools.partial(custom.list_cluster_custom_object, group, version, kind.plural)


# -- the shell -------------------------------------------------------------------------------


class _Stopper:
    """The stop flag of one `run`, and the open watches that stopping must interrupt."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._lock = threading.Lock()
        self._watches: set[Any] = set()

    def stopped(self) -> bool:
        return self._flag.is_set()

    def wait(self, seconds: float) -> None:
        self._flag.wait(seconds)

    @contextlib.contextmanager
    def watching(self, w: Any) -> Iterator[None]:
        with self._lock:
            self._watches.add(w)
        try:
            yield
        finally:
            with self._lock:
                self._watches.discard(w)

    def stop(self) -> None:
        """Idempotent; shuts the socket of every open watch so that its thread wakes up."""
        self._flag.set()
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.stop()


class KubernetesSource:
    """Lists then watches every kind cluster-wide through a `kubernetes` ApiClient.

    `relists[kind]` counts the Snapshots after the first (410 Expired, resync, or a failed list
    retried); `reconnects[kind]` counts failed lists and broken watches that were retried.
    `on_event(kind, lag)` is called after the sink with the seconds the event waited between its
    worker thread and the event loop."""

    def __init__(
        self,
        api_client: Any,
        *,
        kinds: tuple[Kind, ...] = DESTINATION_KINDS,
        resync_interval: float = 300.0,
        watch_timeout: float = 30.0,
        backoff: tuple[float, float] = (0.1, 5.0),
        request_timeout: float = 30.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_event: OnEvent | None = None,
    ) -> None:
        self._kinds = kinds
        self._listers = {kind: lister_for(api_client, kind) for kind in kinds}
        self._resync_interval = resync_interval
        self._watch_timeout = watch_timeout
        self._backoff = backoff
        self._request_timeout = request_timeout
        self._rng = rng if rng is not None else random.Random()
        self._rng_lock = threading.Lock()
        self._clock = clock
        self._on_event = on_event
        self._listed: set[Kind] = set()
        self._running = False
        self.relists: dict[Kind, int] = dict.fromkeys(kinds, 0)
        self.reconnects: dict[Kind, int] = dict.fromkeys(kinds, 0)

    @property
    def synced(self) -> bool:
        return self._listed.issuperset(self._kinds)

    async def run(self, sink: Sink) -> None:
        """Runs until cancelled; raises what the sink raised, after stopping every thread."""
        if self._running:
            raise RuntimeError("KubernetesSource.run is already running")
        self._running = True
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()
        stopper = _Stopper()
        self._listed = set()

        def deliver(event: Event, received: float) -> None:
            if stopper.stopped() or failed.done():
                return
            if isinstance(event, Snapshot):
                self._listed.add(event.kind)
            try:
                sink(event)
                if self._on_event is not None:
                    self._on_event(event.kind, self._clock() - received)
            except Exception as exc:
                failed.set_exception(exc)

        def fail(exc: BaseException) -> None:
            if not failed.done():
                failed.set_exception(exc)

        def report(exc: BaseException) -> None:  # on a worker thread
            loop.call_soon_threadsafe(fail, exc)

        def emit(event: Event) -> None:  # on a worker thread
            try:
                loop.call_soon_threadsafe(deliver, event, self._clock())
            except RuntimeError:  # the loop is closed: nobody is listening any more
                stopper.stop()

        threads = [
            threading.Thread(
                target=self._thread_main,
                args=(kind, stopper, emit, report),
                name=f"informer-{kind.plural}",
                daemon=True,
            )
            for kind in self._kinds
        ]
        try:
            for thread in threads:
                thread.start()
            await failed
        finally:
            await _join(threads, stopper)
            self._running = False

    def _thread_main(
        self,
        kind: Kind,
        stopper: _Stopper,
        emit: Callable[[Event], None],
        fail: Callable[[BaseException], object],
    ) -> None:
        try:
            self._list_and_watch(kind, stopper, emit)
        except BaseException as exc:
            logger.exception("informer for %s crashed", kind.plural)
            with contextlib.suppress(RuntimeError):
                fail(exc)

    def _list_and_watch(self, kind: Kind, stopper: _Stopper, emit: Callable[[Event], None]) -> None:
        lister = self._listers[kind]
        version: str | None = None  # None: list before watching
        resync_at = 0.0
        failures = 0
        relist_reason: str | None = None  # None: nothing listed yet
        while not stopper.stopped():
            phase = "list"
            try:
                if version is None or self._clock() >= resync_at:
                    if version is not None:
                        relist_reason = f"resync every {self._resync_interval:g}s"
                    snapshot, version = self._list(kind, lister)
                    resync_at = self._clock() + self._resync_interval
                    if relist_reason is None:
                        logger.debug("listed %d %s", len(snapshot.objects), kind.plural)
                    else:
                        self.relists[kind] += 1
                        logger.info(
                            "relisted %d %s (%s)", len(snapshot.objects), kind.plural, relist_reason
                        )
                    emit(snapshot)
                    failures = 0
                phase = "watch"
                seconds = watch_seconds(self._watch_timeout, resync_at - self._clock())
                opened, received = self._clock(), 0
                with contextlib.closing(self._watch(lister, version, seconds, stopper)) as events:
                    for event in events:
                        received += 1
                        change, seen = change_of(kind, event)
                        version = seen or version
                        if change is not None:
                            emit(change)
                        elif event.get("type") != "BOOKMARK":
                            logger.warning(
                                "ignored a %r event on %s", event.get("type"), kind.plural
                            )
                        failures = 0
                        if stopper.stopped() or self._clock() >= resync_at:
                            break
                    else:
                        if not received and self._clock() - opened < SHORT_WATCH_SECONDS:
                            raise ShortWatchError("the server ended the watch at once, silently")
                logger.debug("watch of %s ended at resourceVersion %s", kind.plural, version)
            except Exception as exc:
                if stopper.stopped():
                    break
                expired = isinstance(exc, client.ApiException) and exc.status == 410
                if phase == "watch" and expired:
                    relist_reason = f"watch from resourceVersion {version} expired (410)"
                    logger.info("%s: %s; relisting", kind.plural, relist_reason)
                    version = None
                    continue
                self.reconnects[kind] += 1
                delay = self._delay(failures)
                failures += 1
                logger.warning(
                    "%s of %s failed (%s); %s in %.2fs",
                    phase,
                    kind.plural,
                    _describe(exc),
                    "listing" if version is None else f"watching from resourceVersion {version}",
                    delay,
                )
                stopper.wait(delay)

    def _delay(self, attempt: int) -> float:
        with self._rng_lock:  # one rng, shared by every kind's thread
            return backoff_delay(attempt, self._backoff, self._rng)

    def _list(self, kind: Kind, lister: Lister) -> tuple[Snapshot, str]:
        timeout = (self._request_timeout, self._request_timeout)
        response = lister(_preload_content=False, _request_timeout=timeout)
        try:
            body = json.loads(response.data)
        except BaseException:
            response.close()
            raise
        finally:
            response.release_conn()
        return snapshot_of(kind, body)

    def _watch(
        self, lister: Lister, version: str, seconds: int, stopper: _Stopper
    ) -> Generator[Mapping[str, Any], None, None]:
        # return_type "object" keeps events as dicts: no model objects are built.
        w = watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        stream = w.stream(  # type: ignore[no-untyped-call]
            lister,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=seconds,  # also turns off the client's own resume after a 410
            _request_timeout=(self._request_timeout, seconds + self._request_timeout),
        )
        with stopper.watching(w), contextlib.closing(stream):
            yield from stream


def _describe(exc: Exception) -> str:
    if isinstance(exc, client.ApiException):
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


async def _join(threads: list[threading.Thread], stopper: _Stopper) -> None:
    """Stops the worker threads and waits for them, without blocking the event loop."""
    deadline = time.monotonic() + JOIN_SECONDS
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        stopper.stop()  # again: a watch may have opened after the previous call
        await asyncio.sleep(_JOIN_POLL_SECONDS)
    if alive := [t.name for t in threads if t.is_alive()]:
        logger.warning("informer threads still running after %gs: %s", JOIN_SECONDS, alive)
