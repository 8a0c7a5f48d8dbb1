"""How many retries a service can take (pure, the clock passed in): a retry budget as Linkerd's
(tower's `TpsBudget`).

Every request deposits `ratio` of a retry; every retry withdraws one. Deposits and withdrawals
are kept for `ttl` seconds, in SLOTS time slots; on top of what they leave, `min_per_second`
retries per second are always allowed (a reserve of min_per_second * ttl). A retry is allowed
while the balance is at least one: with the defaults (0.2, 10/s, 10 s) retries stay within 20 %
of the requests, plus 10 a second, so that retries never multiply a failing service's load.
"""

from __future__ import annotations

from typing import Final

SLOTS: Final = 10
SCALE: Final = 1000  # tokens per retry: integer arithmetic, so 100 x 0.2 is exactly 20


class RetryBudget:
    def __init__(self, ratio: float, min_per_second: float, ttl: float, now: float) -> None:
        if not 0 <= ratio <= 1000 or min_per_second < 0 or not 1 <= ttl <= 60:
            raise ValueError(f"retry budget out of range: {ratio}, {min_per_second}/s, {ttl}s")
        self.ratio = ratio
        self._deposit = round(ratio * SCALE)
        self._reserve = round(min_per_second * ttl * SCALE)
        self._slot_seconds = ttl / SLOTS
        self._slots = [0] * SLOTS
        self._current = int(now / self._slot_seconds)  # the absolute index of the newest slot

    def _advance(self, now: float) -> None:
        index = int(now / self._slot_seconds)
        if index <= self._current:
            return
        for i in range(self._current + 1, min(index, self._current + SLOTS) + 1):
            self._slots[i % SLOTS] = 0  # slots older than ttl are forgotten
        self._current = index

    def deposit(self, now: float) -> None:
        """A request (not a retry) was made."""
        self._advance(now)
        self._slots[self._current % SLOTS] += self._deposit

    def withdraw(self, now: float) -> bool:
        """Whether a retry may be made now (it is then counted)."""
        self._advance(now)
        if self._reserve + sum(self._slots) < SCALE:
            return False
        self._slots[self._current % SLOTS] -= SCALE
        return True

    def balance(self, now: float) -> float:
        """Retries allowed now."""
        self._advance(now)
        return (self._reserve + sum(self._slots)) / SCALE
