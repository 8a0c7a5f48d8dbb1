"""Owns a controller's background tasks: one supervisor notices a task's death, restarts it after
a backoff, and gives up after too many failures in a row so that the process exits and
Kubernetes restarts it.

While a task is down (from its death until it runs again) the supervisor is not `healthy`, which
the controllers' `/ready` reports at once. A task that ends, by returning or raising, before the
supervisor is `stopping` has failed; one that ends after it is stopping has not. A task that
ends because the supervisor was cancelled (whatever it made of the CancelledError) is never
restarted: the supervisor ends too (`meshlet.api.cancellation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api.backoff import Backoff
from meshlet.api.cancellation import OwnCancellation

log = logging.getLogger(__name__)

MAX_FAILURES: Final = 5  # consecutive failures of one task before the process gives up
RESTART_BACKOFF: Final = (0.5, 10.0)  # seconds: the first wait before a restart, and the cap
# A run this long counts as a recovery: the task's next failure is its first in a row again.
HEALTHY_RUN: Final = 60.0

Work = Callable[[], Coroutine[Any, Any, None]]  # makes a fresh run of a task


@dataclass(frozen=True, slots=True)
class Policy:
    max_failures: int = MAX_FAILURES
    backoff: tuple[float, float] = RESTART_BACKOFF
    healthy_run: float = HEALTHY_RUN


class Supervisor:
    """Runs the tasks given to `add` under one TaskGroup in `run`.

    `stopping` is set by `stop()` (a signal) or when a task has failed `max_failures` times in a
    row; then `failure` says which task and why, and the process should exit 1."""

    def __init__(
        self,
        owner: str,
        policy: Policy | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._owner = owner  # the controller, for the log lines
        self._policy = policy or Policy()
        self._rng = rng or random.Random()
        self._clock = clock
        self._work: dict[str, Work] = {}
        self._down: set[str] = set()
        self.stopping = asyncio.Event()
        self.failure: str | None = None

    def add(self, name: str, work: Work) -> None:
        """`work()` is called for each run of task `name` (e.g. "the issuer watch")."""
        self._work[name] = work

    @property
    def healthy(self) -> bool:
        """Every task is running (none waits to be restarted), and none gave up."""
        return not self._down and self.failure is None

    def stop(self) -> None:
        """Shutdown: tasks that end from now on have not failed."""
        self.stopping.set()

    async def run(self) -> None:
        """Runs every task until cancelled, or until one gives up (then `failure` is set)."""
        async with asyncio.TaskGroup() as tasks:
            for name, work in self._work.items():
                tasks.create_task(self._keep(name, work), name=name)

    async def _keep(self, name: str, work: Work) -> None:
        """Runs `work` again after each failure, until it has failed too often in a row."""
        policy = self._policy
        backoff = Backoff(*policy.backoff, self._rng)
        own = OwnCancellation()
        while True:
            started = self._clock()
            error: Exception | None = None
            try:
                await work()
            except Exception as exc:
                error = exc
            own.check()  # cancelled, whatever the task made of it: never restarted
            why = "it returned" if error is None else f"{type(error).__name__}: {error}"
            if self.stopping.is_set():
                return
            self._down.add(name)
            if self._clock() - started >= policy.healthy_run:
                backoff.reset()
            delay = backoff.next()
            if backoff.failures >= policy.max_failures:
                self.failure = f"{name} failed {backoff.failures} times in a row (last: {why})"
                log.error("%s; %s exits", self.failure, self._owner, exc_info=error)
                self.stopping.set()
                return
            log.error(
                "%s stopped (%s); %s is not ready; restart %d of %d in %.1fs",
                name, why, self._owner, backoff.failures, policy.max_failures - 1, delay,
                exc_info=error,
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.stopping.wait()
            if self.stopping.is_set():
                return
            self._down.discard(name)
            log.info("%s restarted", name)
