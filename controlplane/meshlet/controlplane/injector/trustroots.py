"""The trust-roots bundle's copy in each namespace with meshed pods, which the proxies there
mount and follow (a pod can mount ConfigMaps of its own namespace only).

`ensure(namespace, pem)` makes the copy (ConfigMap `meshlet-trust-roots`, key `ca-bundle.crt`,
labelled `meshlet.io/trust-roots: copy`) or brings it up to date; the webhook calls it for each
pod it meshes (not for a dry run), before it answers, so the pod's volume finds it. A namespace
found current is remembered for CACHE_SECONDS, so a burst of pods costs one request, and a
namespace deleted and made again (its copy with it) gets a new copy. `refresh(pem)`
brings every copy up to date when the control plane's bundle changes (a step of a rotation),
and once at start. Copies are the injector's: one not labelled as a copy is left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from meshlet.api import wellknown as wk

log = logging.getLogger(__name__)

REQUEST_TIMEOUT: Final = 3.0
CACHE_SECONDS: Final = 5.0
MAX_CACHED: Final = 10_000
COPY_SELECTOR: Final = f"{wk.TRUST_ROOTS_COPY_LABEL}=copy"


class CopyError(Exception):
    """A copy could not be read or written; the message says why."""


class TrustRootsCopies:
    def __init__(self, api_client: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from kubernetes import client

        self._core: Any = client.CoreV1Api(api_client)  # untyped: bodies are plain dicts
        self._clock = clock
        self._current: dict[str, float] = {}  # namespace → when its copy was seen holding _pem
        self._pem = ""

    def ensure(self, namespace: str, pem: str) -> bool:
        """Makes `namespace`'s copy hold `pem`; True when it wrote one."""
        now = self._clock()
        if pem != self._pem:
            self._pem, self._current = pem, {}
        if now - self._current.get(namespace, -CACHE_SECONDS) < CACHE_SECONDS:
            return False
        wrote = self._write(namespace, pem, self._read(namespace))
        if len(self._current) >= MAX_CACHED:
            self._current.clear()
        self._current[namespace] = now
        return wrote

    def refresh(self, pem: str) -> int:
        """Brings every copy up to date with `pem`; how many it rewrote."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        self._pem, self._current = pem, {}
        try:
            copies = self._core.list_config_map_for_all_namespaces(
                label_selector=COPY_SELECTOR, _request_timeout=REQUEST_TIMEOUT
            ).items
        except ApiException as exc:
            raise CopyError(f"copies not listed: {exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:
            raise CopyError(f"copies not listed: {exc}") from None
        rewritten = 0
        for copy in copies:
            namespace = copy.metadata.namespace
            if self._write(namespace, pem, copy):
                rewritten += 1
        return rewritten

    def _read(self, namespace: str) -> Any | None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return self._core.read_namespaced_config_map(
                wk.TRUST_ROOTS_COPY, namespace, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise CopyError(
                f"{namespace}/{wk.TRUST_ROOTS_COPY}: {exc.status} {exc.reason}"
            ) from None
        except (HTTPError, OSError) as exc:
            raise CopyError(f"{namespace}/{wk.TRUST_ROOTS_COPY}: {exc}") from None

    def _write(self, namespace: str, pem: str, existing: Any | None) -> bool:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": wk.TRUST_ROOTS_COPY,
                "namespace": namespace,
                "labels": {wk.TRUST_ROOTS_COPY_LABEL: "copy"},
                "annotations": {
                    "meshlet.io/copied-from": f"the control plane's {wk.TRUST_ROOTS_CONFIGMAP}"
                },
            },
            "data": {wk.TRUST_ROOTS_KEY: pem},
        }
        name = f"{namespace}/{wk.TRUST_ROOTS_COPY}"
        try:
            if existing is None:
                self._core.create_namespaced_config_map(
                    namespace, body, _request_timeout=REQUEST_TIMEOUT
                )
                log.info("trust roots copied into %s", name)
                return True
            labels = existing.metadata.labels or {}
            if labels.get(wk.TRUST_ROOTS_COPY_LABEL) != "copy":
                raise CopyError(f"{name} exists and is not meshlet's copy: left alone")
            if (existing.data or {}).get(wk.TRUST_ROOTS_KEY) == pem:
                return False
            # its data alone: the labels and annotations of whoever made it (the chart makes
            # the control plane's) stay
            self._core.patch_namespaced_config_map(
                wk.TRUST_ROOTS_COPY, namespace, {"data": {wk.TRUST_ROOTS_KEY: pem}},
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
            log.info("trust roots brought up to date in %s", name)
            return True
        except ApiException as exc:
            if exc.status == 409:  # another replica of the injector wrote it meanwhile
                return False
            raise CopyError(f"{name} not written: {exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:
            raise CopyError(f"{name} not written: {exc}") from None
