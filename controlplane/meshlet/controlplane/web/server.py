"""Runs the web dashboard (`meshlet-controller web`, Linkerd viz's web): server-rendered pages of
the metrics API's answers from Prometheus, a live tap view relayed from the tap controller, and
the admin server.

It writes nothing anywhere: every route is a GET. Like Linkerd's web server, it answers only a
Host header that `enforced_host` matches in full (localhost and the dashboard's own names by
default), so a page of another site cannot reach it through a DNS name rebound to 127.0.0.1 (a
port-forward). A request head must arrive within `HEAD_TIMEOUT` (limits.HeadGuard). Each page
asks Prometheus in one of `PAGE_WORKERS` threads, all its queries within `PAGE_TIMEOUT`; past
those and `PAGE_WAITING` pages waiting, a page is a 503 at once (limits.Pages); Prometheus down
is a page that says so (503). A tap is relayed line by line, each line and each relay bounded
(`MAX_LINE`, `MAX_RELAY_EVENTS`, `MAX_RELAY_SECONDS`, `MAX_RELAYS` at once), and ends when its
reader leaves.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Final

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from meshlet.api import wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane import vizmetrics
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.listen import bind, start_admin
from meshlet.controlplane.supervise import Supervisor
from meshlet.controlplane.web import pages
from meshlet.controlplane.web.limits import Busy, HeadGuard, Pages

log = logging.getLogger(__name__)

_NAMES = "|".join(
    re.escape(f"{wellknown.WEB_NAME}{tail}")
    for tail in ("", f".{wellknown.CONTROL_PLANE_NAMESPACE}",
                 f".{wellknown.CONTROL_PLANE_NAMESPACE}.svc",
                 f".{wellknown.CONTROL_PLANE_NAMESPACE}.svc.{wellknown.CLUSTER_DOMAIN}")
)  # fmt: skip
DEFAULT_ENFORCED_HOST: Final = rf"^(localhost|127\.0\.0\.1|\[::1\]|{_NAMES})(:\d+)?$"
PROMETHEUS_TIMEOUT: Final = 5.0  # seconds for one query of a page
PAGE_TIMEOUT: Final = 10.0  # seconds for all the queries of a page
PAGE_WORKERS: Final = 4  # pages computed at once
PAGE_WAITING: Final = 8  # pages waiting for a worker; one more is a 503 at once
HEAD_TIMEOUT: Final = 10.0  # seconds a request head may take, from the accept or its first byte
KEEPALIVE_TIMEOUT: Final = 60.0  # seconds a connection may stay idle between requests
MAX_QUERY_VALUE: Final = 1024  # characters of one query parameter
MAX_RELAYS: Final = 8  # taps relayed at once; one more is refused (429)
MAX_LINE: Final = 64 * 1024  # bytes of one line of the tap controller's answer
MAX_RELAY_EVENTS: Final = 10_000  # lines one relay passes on before it ends
MAX_RELAY_SECONDS: Final = 600.0  # how long one relay runs at most
MAX_ERROR_BODY: Final = 8 * 1024  # bytes read of the tap controller's refusal
MAX_TAP_ERRORS: Final = 3  # proxies' errors a tap's last line repeats
MAX_TAP_ERROR: Final = 300  # characters of each
RELAY_RPS: Final = "20"  # requests per second a browser's tap asks for (the table shows 100)
TAP_CONNECT_TIMEOUT: Final = 5.0
_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_RESOURCE: Final = re.compile(r"^[A-Za-z]{1,16}(/[A-Za-z0-9][A-Za-z0-9._:-]{0,252})?$")
_PATH: Final = re.compile(r"^/[\x21-\x7e]{0,1023}$")
STATIC: Final = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class WebConfig:
    addr: HostPort
    admin_addr: HostPort
    prometheus_url: str
    tap_addr: HostPort = HostPort("127.0.0.1", wellknown.TAP_PORT)
    enforced_host: str = DEFAULT_ENFORCED_HOST
    max_relays: int = MAX_RELAYS
    max_relay_events: int = MAX_RELAY_EVENTS
    max_relay_seconds: float = MAX_RELAY_SECONDS
    head_timeout: float = HEAD_TIMEOUT
    page_workers: int = PAGE_WORKERS
    page_waiting: int = PAGE_WAITING
    page_timeout: float = PAGE_TIMEOUT


class BadQuery(ValueError):
    """A query parameter the dashboard does not take; the message says which and why."""


def query(request: web.Request, allowed: dict[str, Callable[[str], str]]) -> dict[str, str]:
    """The request's query parameters, each checked by its validator; BadQuery for an unknown
    one, a repeated one, one too long or one its validator refuses."""
    out: dict[str, str] = {}
    for key, value in request.query.items():
        check = allowed.get(key)
        if check is None:
            raise BadQuery(f"unknown parameter {key[:40]!r}")
        if key in out:
            raise BadQuery(f"parameter {key!r} given twice")
        if len(value) > MAX_QUERY_VALUE:
            raise BadQuery(f"parameter {key!r} is over {MAX_QUERY_VALUE} characters")
        out[key] = check(value) if value else ""
    return out


def window(value: str) -> str:
    if value not in pages.WINDOWS:
        raise BadQuery(f"window must be one of {', '.join(pages.WINDOWS)}")
    return value


def namespace(value: str) -> str:
    if not _DNS_LABEL.match(value):
        raise BadQuery("namespace must be a DNS label (lowercase letters, digits, '-')")
    return value


def resource(value: str) -> str:
    if not _RESOURCE.match(value):
        raise BadQuery("resource must be TYPE or TYPE/NAME, like deploy/web")
    try:
        vizmetrics.target(value, None)
    except ValueError as exc:
        raise BadQuery(str(exc)) from None
    return value


def path_prefix(value: str) -> str:
    if not _PATH.match(value):
        raise BadQuery("path must start with '/' and hold printable characters only")
    return value


def method(value: str) -> str:
    if value.upper() not in pages.TAP_METHODS:
        raise BadQuery(f"method must be one of {', '.join(m for m in pages.TAP_METHODS if m)}")
    return value.upper()


def kind(value: str) -> str:
    if value not in ("deploy", "po"):
        raise BadQuery("kind must be deploy or po")
    return value


def host_allowed(pattern: re.Pattern[str], host: str | None) -> bool:
    return host is not None and pattern.fullmatch(host) is not None


class Relay:
    """Splits the tap controller's answer into lines, each at most `MAX_LINE` bytes."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines (without their newline) `data` finishes; ValueError when a line
        grows past `MAX_LINE`."""
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        if len(self._buffer) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
            raise ValueError(f"a tap event of over {MAX_LINE} bytes")
        return [line for line in lines if line.strip()]


class TapErrors:
    """The proxies' stream errors a tap carried (`{"type": "error", ...}` lines: the tap
    controller's own words, `PERMISSION_DENIED: ...`), so that the tap's last line says why it
    ended; the first `MAX_TAP_ERRORS`, each cut to `MAX_TAP_ERROR` characters."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.count = 0

    def see(self, line: bytes) -> None:
        if b'"error"' not in line:  # most lines are requests: no parse
            return
        try:
            doc = json.loads(line)
        except ValueError:
            return
        if not isinstance(doc, dict) or doc.get("type") != "error":
            return
        self.count += 1
        if len(self.messages) < MAX_TAP_ERRORS:
            proxy, message = doc.get("proxy"), str(doc.get("message") or "no reason given")
            text = f"{proxy}: {message}" if proxy else message
            self.messages.append(text[:MAX_TAP_ERROR])

    def ended(self, why: str) -> str:
        if not self.messages:
            return why
        more = self.count - len(self.messages)
        tail = f" (and {more} more)" if more else ""
        return f"{why} after errors: {'; '.join(self.messages)}{tail}"


class WebServer:
    def __init__(self, config: WebConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.prom = vizmetrics.Prometheus(config.prometheus_url, timeout=PROMETHEUS_TIMEOUT)
        self.enforced_host = re.compile(config.enforced_host)
        self.relays = 0
        self.pages = Pages(config.page_workers, config.page_waiting)
        self._listener: asyncio.Server | None = None
        self._requests = Counter(
            "web_requests_total", "Requests answered, by status code.", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self._refused = Counter(
            "web_refused_total",
            "Requests refused, by reason (host, invalid, busy: taps, overloaded: pages,"
            " head_timeout).",
            ["reason"],
            registry=self.registry,
        )
        self._prometheus_errors = Counter(
            "web_prometheus_errors_total",
            "Pages that Prometheus could not answer.",
            registry=self.registry,
        )
        relays = Gauge("web_tap_relays", "Taps being relayed.", registry=self.registry)
        relays.set_function(lambda: self.relays)
        self._admin = AdminServer(partial(generate_latest, self.registry), ready=self.ready)
        self.supervisor = Supervisor("web")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0
        self.admin_port = 0

    def ready(self) -> bool:
        return self.port != 0 and self.supervisor.healthy

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self.namespaces)
        app.router.add_get("/namespaces/{namespace}", self.namespace)
        app.router.add_get("/topology", self.topology)
        app.router.add_get("/routes", self.routes)
        app.router.add_get("/tap", self.tap_page)
        app.router.add_get("/api/tap", self.tap)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_get("/favicon.ico", self.no_icon)
        return app

    async def start(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=TAP_CONNECT_TIMEOUT),
            auto_decompress=False,
        )
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,  # a tap reader that leaves ends its relay
            shutdown_timeout=1.0,
            keepalive_timeout=KEEPALIVE_TIMEOUT,
        )
        await self._runner.setup()
        sock = bind(cfg.addr, "web")
        self.port = sock.getsockname()[1]
        server = self._runner.server
        assert server is not None

        def guarded() -> asyncio.Protocol:
            timed_out = self._refused.labels("head_timeout").inc
            return HeadGuard(server(), cfg.head_timeout, timed_out)

        self._listener = await asyncio.get_running_loop().create_server(guarded, sock=sock)
        self.admin_port = await start_admin(self._admin, cfg.admin_addr)
        log.info("web serving on :%d (admin :%d), Prometheus %s, tap %s", self.port,
                 self.admin_port, cfg.prometheus_url, cfg.tap_addr)  # fmt: skip

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.pages.close()
        if self._session is not None:
            await self._session.close()
        await self._admin.close()

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not host_allowed(self.enforced_host, request.headers.get("Host")):
            self._refused.labels("host").inc()
            response: web.StreamResponse = web.Response(
                status=403,
                text="This Host header is not one the dashboard answers (--enforced-host).\n",
            )
        else:
            try:
                response = await handler(request)
            except BadQuery as exc:
                self._refused.labels("invalid").inc()
                response = _html(pages.error_page("Bad request", str(exc)), 400)
            except web.HTTPException as exc:
                response = web.Response(status=exc.status, text=f"{exc.reason}\n")
            except Busy as exc:
                self._refused.labels("overloaded").inc()
                message = f"The dashboard is busy ({exc}): try again in a moment."
                response = _html(pages.error_page("Busy", message), 503)
                response.headers["Retry-After"] = "1"
        if not response.prepared:
            response.headers.update(SECURITY_HEADERS)
        self._requests.labels(str(response.status)).inc()
        return response

    def _prom(self) -> vizmetrics.Prometheus:
        """Prometheus for one page, from when its worker starts: every query within the
        page's time."""
        return self.prom.within(self.config.page_timeout)

    def _unavailable(self, exc: vizmetrics.MetricsError, active: str) -> web.Response:
        self._prometheus_errors.inc()
        message = f"Prometheus cannot answer: {exc}"
        return _html(pages.error_page("Prometheus unavailable", message, active), 503)

    async def namespaces(self, request: web.Request) -> web.Response:
        q = query(request, {"window": window})
        w = q.get("window") or pages.DEFAULT_WINDOW
        t = vizmetrics.Target("namespace")

        def work() -> str:
            prom = self._prom()
            rows = vizmetrics.stat(prom, vizmetrics.stat_query(t), w)
            meshed = vizmetrics.meshed_pods(prom, "namespace", None)
            rows = pages.with_idle(rows, meshed, vizmetrics.seconds(w))
            return pages.namespaces_page(rows, meshed, w)

        try:
            return _html(await self.pages.run(work))
        except vizmetrics.MetricsError as exc:
            return self._unavailable(exc, "/")

    async def namespace(self, request: web.Request) -> web.Response:
        ns = namespace(request.match_info["namespace"])
        w = query(request, {"window": window}).get("window") or pages.DEFAULT_WINDOW

        def work() -> str:
            prom = self._prom()
            found = {}
            meshed = {}
            for k in ("deployment", "pod"):
                t = vizmetrics.Target(k, None, ns)
                rows = vizmetrics.stat(prom, vizmetrics.stat_query(t), w)
                meshed[k] = vizmetrics.meshed_pods(prom, k, ns)
                found[k] = pages.with_idle(rows, meshed[k], vizmetrics.seconds(w))
            return pages.namespace_page(ns, found["deployment"], found["pod"], meshed, w)

        try:
            return _html(await self.pages.run(work))
        except vizmetrics.MetricsError as exc:
            return self._unavailable(exc, "/")

    async def topology(self, request: web.Request) -> web.Response:
        q = query(request, {"window": window, "namespace": namespace, "kind": kind})
        w, ns, k = q.get("window") or pages.DEFAULT_WINDOW, q.get("namespace", ""), q.get("kind")
        k = k or "deploy"
        label = vizmetrics.KINDS[k]
        try:
            found = await self.pages.run(
                lambda: vizmetrics.edges(self._prom(), label, w, ns or None)
            )
        except vizmetrics.MetricsError as exc:
            return self._unavailable(exc, "/topology")
        return _html(pages.topology_page(found, k, ns, w))

    async def routes(self, request: web.Request) -> web.Response:
        q = query(request, {"window": window, "namespace": namespace, "resource": resource})
        w, ns = q.get("window") or pages.DEFAULT_WINDOW, q.get("namespace", "")
        res = q.get("resource") or "deploy"
        t = vizmetrics.target(res, ns or None)
        try:
            found = await self.pages.run(lambda: vizmetrics.routes(self._prom(), t, w))
        except vizmetrics.MetricsError as exc:
            return self._unavailable(exc, "/routes")
        return _html(pages.routes_page(found, res, ns, w))

    async def tap_page(self, request: web.Request) -> web.Response:
        q = query(request, TAP_PARAMETERS | {"window": window})
        return _html(pages.tap_page(q.get("resource", ""), q.get("namespace", ""),
                                    q.get("path", ""), q.get("method", "")))  # fmt: skip

    async def no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        content_type = STATIC.get(name)
        if content_type is None:
            raise web.HTTPNotFound()
        body = importlib.resources.files(__package__).joinpath("static", name).read_bytes()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def tap(self, request: web.Request) -> web.StreamResponse:
        """Relays `GET /api/v1/tap` of the tap controller, a JSON object a line."""
        q = query(request, TAP_PARAMETERS)
        if not q.get("resource"):
            raise BadQuery("resource is required (deploy/NAME, po/NAME or ns/NAME)")
        if self.relays >= self.config.max_relays:
            self._refused.labels("busy").inc()
            message = f"{self.config.max_relays} taps are open: close one"
            return _json({"type": "error", "message": message}, 429)
        upstream = {k: v for k, v in q.items() if v} | {"max_rps": RELAY_RPS}
        tap = self.config.tap_addr
        url = f"http://{tap}/api/v1/tap?" + urllib.parse.urlencode(upstream)
        assert self._session is not None
        self.relays += 1
        try:
            try:
                answer = await self._session.get(url)
            except (aiohttp.ClientError, OSError) as exc:
                message = f"cannot reach the tap controller at {tap}: {exc}"
                return _json({"type": "error", "message": message}, 502)
            async with answer:
                if answer.status != 200:
                    body = await answer.content.read(MAX_ERROR_BODY)
                    return _json({"type": "error", "message": _refusal(answer.status, body)},
                                 answer.status if answer.status < 500 else 502)  # fmt: skip
                response = web.StreamResponse(headers={
                    "Content-Type": "application/x-ndjson", **SECURITY_HEADERS,
                })  # fmt: skip
                await response.prepare(request)
                await self._relay(answer, response)
                return response
        finally:
            self.relays -= 1

    async def _relay(self, answer: aiohttp.ClientResponse, response: web.StreamResponse) -> None:
        lines, sent, errors = Relay(), 0, TapErrors()
        most, seconds = self.config.max_relay_events, self.config.max_relay_seconds
        try:
            async with asyncio.timeout(seconds):
                async for data in answer.content.iter_any():
                    for line in lines.feed(data):
                        errors.see(line)
                        await response.write(line + b"\n")
                        sent += 1
                        if sent >= most:
                            await _end(response, f"{most} events: tap again")
                            return
        except TimeoutError:
            await _end(response, f"{seconds:g}s passed: tap again")
            return
        except ValueError as exc:
            await _end(response, str(exc))
            return
        except aiohttp.ClientError as exc:
            await _end(response, f"the tap controller's stream broke: {exc}")
            return
        await _end(response, errors.ended("the tap controller ended the tap"))


TAP_PARAMETERS: Final[dict[str, Callable[[str], str]]] = {
    "resource": resource, "namespace": namespace, "path": path_prefix, "method": method,
}  # fmt: skip


def _refusal(status: int, body: bytes) -> str:
    try:
        doc = json.loads(body)
        message = str(doc.get("message")) if isinstance(doc, dict) else ""
    except ValueError:
        message = ""
    return message or f"the tap controller answered {status}"


async def _end(response: web.StreamResponse, why: str) -> None:
    await response.write(json.dumps({"type": "end_of_tap", "message": why}).encode() + b"\n")


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _json(doc: dict[str, object], status: int) -> web.Response:
    return web.json_response(doc, status=status)


async def serve(config: WebConfig, registry: CollectorRegistry | None = None) -> int:
    """Serves until SIGTERM or SIGINT (0)."""
    return await serve_until_signalled(WebServer(config, registry), "web")
