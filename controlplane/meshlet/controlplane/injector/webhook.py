"""The mutating webhook over HTTPS: reads a review, asks the pure core, answers in time.

Every understood review gets an answer within `answer_within` seconds (under the webhook's
timeout): when the namespace cannot be read in time, or anything unexpected happens, the pod is
allowed without a patch and the reason is logged and counted. Malformed reviews get 400 with the
reason; bodies over 1 MiB get 413.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from meshlet.controlplane.injector import review
from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.namespaces import NamespaceError

log = logging.getLogger(__name__)

NamespaceLookup = Callable[[str], Awaitable[Mapping[str, str]]]
PATHS: Final = ("/", "/inject")
TIMEOUT: Final = "timeout"
INTERNAL_ERROR: Final = "internal_error"


class InjectorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.responses = Counter(
            "proxy_inject_admission_responses",
            "Admission reviews answered, by outcome",
            ["skip", "skip_reason", "annotation_at", "owner_kind"],
            registry=registry,
        )
        self.rejected = Counter(
            "proxy_inject_admission_rejected",
            "Requests refused as malformed (400) or too large (413)",
            ["code"],
            registry=registry,
        )


def _bounded(owner_kind: str) -> str:
    # A label value from the request: only the kinds the injector knows are kept.
    known = {"pod", "deployment", "statefulset", "daemonset", "replicaset", "job", "cronjob",
             "replicationcontroller"}  # fmt: skip
    return owner_kind if owner_kind in known else "other" if owner_kind else ""


class Webhook:
    def __init__(
        self,
        config: InjectConfig,
        namespaces: NamespaceLookup | None,
        metrics: InjectorMetrics,
        answer_within: float = 8.0,
    ) -> None:
        self.config = config
        self._namespaces = namespaces
        self._metrics = metrics
        self._answer_within = answer_within

    def app(self) -> web.Application:
        app = web.Application(client_max_size=review.MAX_BODY)
        for path in PATHS:
            app.router.add_post(path, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._metrics.rejected.labels("413").inc()
            return web.Response(
                status=413, text=f"the review is larger than {review.MAX_BODY} bytes\n"
            )
        try:
            parsed = review.parse(body)
        except review.ReviewError as exc:
            self._metrics.rejected.labels("400").inc()
            log.warning("refused a malformed review from %s: %s", request.remote, exc)
            return web.Response(status=400, text=f"{exc}\n")
        try:
            async with asyncio.timeout(self._answer_within):
                outcome = await self._admit(parsed)
        except TimeoutError:
            log.error("no answer within %.1fs for %s; allowed unmeshed", self._answer_within,
                      parsed.uid)  # fmt: skip
            outcome = review.Outcome(
                (), TIMEOUT, "none", "", ("not meshed: the injector timed out",)
            )
        except Exception:
            log.exception("review %s failed; allowed unmeshed", parsed.uid)
            outcome = review.Outcome(
                (), INTERNAL_ERROR, "none", "", ("not meshed: injector error",)
            )
        self._metrics.responses.labels(
            "false" if outcome.patch else "true",
            outcome.skip_reason,
            outcome.annotation_at,
            _bounded(outcome.owner_kind),
        ).inc()
        if outcome.patch:
            log.info("meshed %s %s in %s", parsed.kind, parsed.uid, parsed.namespace)
        body = review.allowed(parsed.uid, outcome.patch, outcome.warnings)
        return web.Response(body=body, content_type="application/json")

    async def _admit(self, request: review.Request) -> review.Outcome:
        ns_annotations: Mapping[str, str] = {}
        problem = None
        if self._namespaces is not None and request.namespace:
            try:
                ns_annotations = await self._namespaces(request.namespace)
            except NamespaceError as exc:
                problem = (
                    f"namespace {request.namespace} not read ({exc}): its annotations are ignored"
                )
                log.warning("%s", problem)
        outcome = review.admit(request, ns_annotations, self.config)
        if problem is None:
            return outcome
        return review.Outcome(
            outcome.patch,
            outcome.skip_reason,
            outcome.annotation_at,
            outcome.owner_kind,
            (problem, *outcome.warnings),
        )
