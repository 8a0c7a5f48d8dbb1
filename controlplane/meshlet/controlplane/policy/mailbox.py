"""Owns a watch stream's slot: the inbound and outbound indexes put each new policy of a watched
port in the mailboxes of its streams, and each stream takes from its own."""

from __future__ import annotations

from collections.abc import Callable


class Mailbox:
    """One watch stream's slot: holds only the latest message (each message is the whole
    policy, so a stream that falls behind skips to the newest and never needs a queue)."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.latest: bytes | None = None
        self.closed = False
        self._on_change = on_change

    def put(self, message: bytes) -> None:
        self.latest = message
        if self._on_change is not None:
            self._on_change()

    def take(self) -> bytes | None:
        message, self.latest = self.latest, None
        return message

    def close(self) -> None:
        self.closed = True
        if self._on_change is not None:
            self._on_change()
