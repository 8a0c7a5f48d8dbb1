"""Token validators: the tokens file and the interpretation of a TokenReview status."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from meshlet.controlplane.identity.errors import CertifyError
from meshlet.controlplane.identity.tokens import (
    ServiceAccount,
    TokensFile,
    TokensFileError,
    account_from_review,
    parse_tokens_file,
)


def test_parse_tokens_file() -> None:
    tokens = parse_tokens_file("tok-a: {namespace: ns1, serviceaccount: sa1}\n")
    assert tokens == {"tok-a": ServiceAccount("ns1", "sa1")}


def test_every_bad_entry_is_reported() -> None:
    text = "good: {namespace: a, serviceaccount: b}\nbad1: x\nbad2: {namespace: a}\n"
    with pytest.raises(TokensFileError, match=r"entry 1.*entry 2"):
        parse_tokens_file(text)


@pytest.mark.parametrize("text", ["[1, 2]", "a: [", "just a string"])
def test_rejects_non_mapping(text: str) -> None:
    with pytest.raises(TokensFileError):
        parse_tokens_file(text)


async def test_tokens_file_is_reread_on_change(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("t1: {namespace: ns, serviceaccount: a}\n")
    validator = TokensFile(path)
    assert await validator.validate("t1") == ServiceAccount("ns", "a")
    path.write_text("t2: {namespace: ns, serviceaccount: b}\n# longer\n")
    assert await validator.validate("t2") == ServiceAccount("ns", "b")
    with pytest.raises(CertifyError) as caught:
        await validator.validate("t1")
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_broken_rewrite_keeps_previous_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("t1: {namespace: ns, serviceaccount: a}\n")
    validator = TokensFile(path)
    path.write_text("t1: [broken\n")
    assert await validator.validate("t1") == ServiceAccount("ns", "a")


def _status(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = {
        "authenticated": True,
        "error": None,
        "audiences": ["identity.meshlet.io"],
        "user": SimpleNamespace(username="system:serviceaccount:emojivoto:web"),
    }
    base.update(kw)
    return SimpleNamespace(**base)


def test_review_maps_username() -> None:
    assert account_from_review(_status()) == ServiceAccount("emojivoto", "web")


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (_status(authenticated=False, error="token expired"), "token expired"),
        (_status(audiences=["api"]), "audience identity.meshlet.io not granted"),
        (_status(user=SimpleNamespace(username="alice")), "not a service account"),
        (
            _status(user=SimpleNamespace(username="system:serviceaccount:ns")),
            "not a service account",
        ),
        (None, "rejected"),
    ],
)
def test_review_refusals(status: SimpleNamespace | None, message: str) -> None:
    with pytest.raises(CertifyError, match=message) as caught:
        account_from_review(status)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
