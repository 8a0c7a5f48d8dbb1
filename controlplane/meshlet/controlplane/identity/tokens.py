"""Token validators: who does a ServiceAccount token belong to?"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import yaml

from meshlet.api import wellknown
from meshlet.controlplane.identity.errors import CertifyError

log = logging.getLogger(__name__)

_SA_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True, slots=True)
class ServiceAccount:
    namespace: str
    name: str


class TokenValidator(Protocol):
    async def validate(self, token: str) -> ServiceAccount:
        """The token's service account; CertifyError when it proves none."""
        ...


def _unauthenticated(why: str) -> CertifyError:
    return CertifyError(grpc.StatusCode.FAILED_PRECONDITION, f"token not authenticated: {why}")


class TokensFileError(ValueError):
    pass


def parse_tokens_file(text: str) -> dict[str, ServiceAccount]:
    """`<token>: {namespace: <ns>, serviceaccount: <sa>}` entries; every bad entry is reported."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TokensFileError(f"tokens file is not YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise TokensFileError("tokens file must map each token to {namespace, serviceaccount}")
    tokens: dict[str, ServiceAccount] = {}
    errors: list[str] = []
    for index, (token, entry) in enumerate(data.items()):
        if not isinstance(token, str) or not token:
            errors.append(f"entry {index}: the token must be a non-empty string")
            continue
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("namespace"), str)
            or not isinstance(entry.get("serviceaccount"), str)
            or set(entry) - {"namespace", "serviceaccount"}
        ):
            errors.append(
                f"entry {index}: expected exactly the string keys namespace, serviceaccount"
            )
            continue
        tokens[token] = ServiceAccount(entry["namespace"], entry["serviceaccount"])
    if errors:
        raise TokensFileError("; ".join(errors))
    return tokens


class TokensFile:
    """Tokens listed in a YAML file (the local mesh); the file is re-read when it changes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self._tokens: dict[str, ServiceAccount] = {}
        self._refresh()

    def _refresh(self) -> None:
        stat = self._path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        self._tokens = parse_tokens_file(self._path.read_text())
        self._stamp = stamp

    async def validate(self, token: str) -> ServiceAccount:
        try:
            self._refresh()
        except (OSError, TokensFileError) as exc:
            log.error("keeping the previous tokens: %s", exc)
        account = self._tokens.get(token)
        if account is None:
            raise _unauthenticated("unknown token")
        return account


class TokenReviewer:
    """Kubernetes TokenReview with audience `identity.meshlet.io` (the client is synchronous,
    so reviews run in worker threads, at most `concurrency` at once)."""

    def __init__(self, api_client: Any, concurrency: int = 8) -> None:
        from kubernetes import client

        self._api = client.AuthenticationV1Api(api_client)
        self._client = client
        self._slots = asyncio.Semaphore(concurrency)

    async def validate(self, token: str) -> ServiceAccount:
        async with self._slots:
            status = await asyncio.to_thread(self._review, token)
        return account_from_review(status)

    def _review(self, token: str) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        body = self._client.V1TokenReview(
            spec=self._client.V1TokenReviewSpec(token=token, audiences=[wellknown.TOKEN_AUDIENCE])
        )
        try:
            return self._api.create_token_review(body, _request_timeout=5).status
        except (ApiException, HTTPError, OSError) as exc:
            log.warning("TokenReview failed: %s", exc)
            raise CertifyError(
                grpc.StatusCode.UNAVAILABLE, "could not review the token with the API server"
            ) from exc


def account_from_review(status: Any) -> ServiceAccount:
    """Interprets a V1TokenReviewStatus."""
    if status is None or not status.authenticated:
        raise _unauthenticated((status.error if status is not None else None) or "rejected")
    audiences = status.audiences or []
    if wellknown.TOKEN_AUDIENCE not in audiences:
        raise _unauthenticated(f"audience {wellknown.TOKEN_AUDIENCE} not granted")
    username = status.user.username if status.user is not None else ""
    parts = username[len(_SA_PREFIX) :].split(":") if username.startswith(_SA_PREFIX) else []
    if len(parts) != 2 or not all(parts):
        raise _unauthenticated(f"{username!r} is not a service account")
    return ServiceAccount(namespace=parts[0], name=parts[1])
