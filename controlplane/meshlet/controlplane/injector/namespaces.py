"""Namespace annotations for the webhook, read from the API server and kept for a few seconds
so that a burst of pods in one namespace costs one request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Final

CACHE_SECONDS: Final = 5.0
MAX_CACHED: Final = 10_000
REQUEST_TIMEOUT: Final = 3.0


class NamespaceError(Exception):
    """The namespace could not be read; the message says why."""


class Namespaces:
    def __init__(self, api_client: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._clock = clock
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}

    async def annotations(self, name: str) -> dict[str, str]:
        now = self._clock()
        cached = self._cache.get(name)
        if cached is not None and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        annotations = await asyncio.to_thread(self._read, name)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[name] = (now, annotations)
        return annotations

    def _read(self, name: str) -> dict[str, str]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            ns = self._core.read_namespace(name, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            raise NamespaceError(f"{exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:
            raise NamespaceError(str(exc)) from None
        meta = ns.metadata
        return dict((meta.annotations if meta is not None else None) or {})
