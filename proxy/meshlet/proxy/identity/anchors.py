"""The trust anchors every TLS context of the proxy verifies against, followed while it runs.

They start as MESHLET_PROXY_IDENTITY_TRUST_ANCHORS (PEM text, as Linkerd's proxy has them) or,
when MESHLET_PROXY_IDENTITY_TRUST_ANCHORS_FILE names a file that holds a valid bundle, as that
file: on a cluster the injector mounts its namespace's copy of the control plane's
trust-roots ConfigMap there. `follow()` reads the
file every FOLLOW_EVERY seconds (a ConfigMap volume is updated by swapping a symlink, which no
inotify watch on the file sees) and, when it holds another valid bundle, makes it current and
tells every holder of a context built on the old one (`on_change`): the identity manager
rebuilds its contexts (and renews at once when its certificate no longer chains to the new
anchors), the control-plane channels reconnect. Adding an anchor, rolling the issuer and
removing the old anchor so take no restart (docs/identity.md, Rotating the trust anchor).

A file that is missing, empty or not a bundle of certificates keeps the current anchors and is
logged once per content, and `identity_trust_anchors_reload_total{result}` counts each
change seen ("ok" or "invalid"). `identity_trust_anchors` is the number of anchors in force.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from meshlet.api import bundle

log = logging.getLogger(__name__)

FOLLOW_EVERY: Final = 2.0  # seconds between looks at the file


def fingerprint(pem: str) -> str:
    """A short name of a bundle for log lines: its SHA-256, 12 hex digits."""
    import hashlib  # here: the running proxy has no other use for it

    return hashlib.sha256(pem.encode()).hexdigest()[:12]


class TrustAnchors:
    """The anchors in force (`pem`), and `version`, counting the changes."""

    def __init__(
        self,
        pem: str,
        path: Path | None = None,
        every: float = FOLLOW_EVERY,
        counted: Callable[[str], Any] | None = None,
    ) -> None:
        self.pem = pem
        self.path = path
        self.every = every
        self.version = 0
        self._callbacks: list[Callable[[], None]] = []
        self._refused: str | None = None  # the last content refused, logged once
        self._counted = counted  # result -> a counter child: `.inc()`d per change seen
        if path is not None:
            text = _read(path)
            if text is not None and text != pem and bundle.problem(text) is None:
                self.pem = text

    @property
    def count(self) -> int:
        return bundle.count(self.pem)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def check(self) -> bool:
        """Reads the file once; True when it changed the anchors in force."""
        if self.path is None:
            return False
        text = _read(self.path)
        if text is None or text == self.pem or text == self._refused:
            return False
        why = bundle.problem(text)
        if why is not None:
            self._refused = text
            self._count("invalid")
            log.warning("trust anchors: %s changed but %s; keeping the %d anchor(s) in force"
                        " (%s)", self.path, why, self.count, fingerprint(self.pem))  # fmt: skip
            return False
        old = fingerprint(self.pem)
        self.pem, self._refused = text, None
        self.version += 1
        self._count("ok")
        log.info("trust anchors: now %d anchor(s) from %s (%s, was %s)", self.count, self.path,
                 fingerprint(text), old)  # fmt: skip
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("trust anchors: a change callback failed")
        return True

    def _count(self, result: str) -> None:
        if self._counted is not None:
            self._counted(result).inc()

    async def follow(self) -> None:
        """Follows the file until cancelled (returns at once without one)."""
        if self.path is None:
            return
        while True:
            await asyncio.sleep(self.every)
            self.check()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
