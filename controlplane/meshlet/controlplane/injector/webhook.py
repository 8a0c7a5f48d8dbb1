"""The webhooks over HTTPS: reads a review, asks the pure core, answers in time.

Two paths share the reading: `/inject` (and `/`) is the mutating webhook that meshes pods,
`/validate` the validating webhook that refuses invalid meshlet objects (ServiceProfiles, and
whatever `validators.VALIDATORS` lists). Every understood review gets an answer within
`answer_within` seconds (under the webhook's timeout): when the namespace cannot be read in
time, a validator takes too long, or anything unexpected happens, the request is allowed (a pod
without a patch, an object unjudged), with the reason as a warning, a log line and a count, as
the webhooks' `failurePolicy: Ignore` would. Malformed reviews get 400 with the reason; bodies
over 1 MiB get 413.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from meshlet.api import wellknown
from meshlet.controlplane.injector import review, validation
from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.namespaces import NamespaceError
from meshlet.controlplane.injector.trustroots import CopyError, TrustRootsCopies
from meshlet.controlplane.injector.validators import VALIDATORS, Validator

log = logging.getLogger(__name__)

NamespaceLookup = Callable[[str], Awaitable[Mapping[str, str]]]
PATHS: Final = ("/", "/inject")
VALIDATE_PATH: Final = wellknown.INJECTOR_VALIDATE_PATH
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
        self.validations = Counter(
            "validation_admission_responses",
            "Objects judged by the validating webhook, by kind and verdict",
            ["kind", "allowed"],
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
        validators: Mapping[tuple[str, str], Validator] = VALIDATORS,
        copies: TrustRootsCopies | None = None,
    ) -> None:
        self.config = config
        self._copies = copies
        self._namespaces = namespaces
        self._metrics = metrics
        self._answer_within = answer_within
        self._validators = validators

    def app(self) -> web.Application:
        app = web.Application(client_max_size=review.MAX_BODY)
        for path in PATHS:
            app.router.add_post(path, self.handle)
        app.router.add_post(VALIDATE_PATH, self.validate)
        return app

    async def _read(self, request: web.Request) -> review.Request | web.Response:
        """The review, or the 413/400 answer to send instead."""
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._metrics.rejected.labels("413").inc()
            return web.Response(
                status=413, text=f"the review is larger than {review.MAX_BODY} bytes\n"
            )
        try:
            return review.parse(body)
        except review.ReviewError as exc:
            self._metrics.rejected.labels("400").inc()
            log.warning("refused a malformed review from %s: %s", request.remote, exc)
            return web.Response(status=400, text=f"{exc}\n")

    async def validate(self, request: web.Request) -> web.Response:
        parsed = await self._read(request)
        if isinstance(parsed, web.Response):
            return parsed
        warnings: tuple[str, ...] = ()
        try:
            async with asyncio.timeout(self._answer_within):
                verdict = await asyncio.to_thread(validation.judge, parsed, self._validators)
        except TimeoutError:
            log.error("%s not judged within %.1fs; allowed", validation.subject(parsed),
                      self._answer_within)  # fmt: skip
            verdict = validation.Verdict(allowed=True, judged=False, message="")
            warnings = ("not validated: the validator timed out",)
        except Exception:
            log.exception("%s not judged; allowed", validation.subject(parsed))
            verdict = validation.Verdict(allowed=True, judged=False, message="")
            warnings = ("not validated: validator error",)
        known = (parsed.group, parsed.kind) in self._validators
        self._metrics.validations.labels(
            parsed.kind if known else "other", "true" if verdict.allowed else "false"
        ).inc()
        if not verdict.allowed:
            log.info("refused %s: %s", validation.subject(parsed), verdict.message)
        body = validation.answer(parsed.uid, verdict, warnings)
        return web.Response(body=body, content_type="application/json")

    async def handle(self, request: web.Request) -> web.Response:
        parsed = await self._read(request)
        if isinstance(parsed, web.Response):
            return parsed
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
        if outcome.patch and self._copies is not None and request.namespace and not request.dry_run:
            try:
                await asyncio.to_thread(self._copies.ensure, request.namespace,
                                        self.config.trust_anchors_pem)  # fmt: skip
            except CopyError as exc:
                log.warning("%s", exc)
                problem = (f"the trust roots are not in namespace {request.namespace} ({exc}):"
                           " its proxy keeps the anchors it starts with")  # fmt: skip
        if problem is None:
            return outcome
        return review.Outcome(
            outcome.patch,
            outcome.skip_reason,
            outcome.annotation_at,
            outcome.owner_kind,
            (problem, *outcome.warnings),
        )
