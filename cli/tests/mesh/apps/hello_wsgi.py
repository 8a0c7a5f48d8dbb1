"""A WSGI application of the kind Flask or Django serves: it says hello and names its pod."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = f"hello from {os.environ.get('POD_NAME')} {environ['PATH_INFO']}\n".encode()
    start_response("200 OK", [("content-type", "text/plain"), ("content-length", str(len(body)))])
    return [body]
