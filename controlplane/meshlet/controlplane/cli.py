"""Shared pieces of the controllers' command line: env-backed options, addresses, exit 64."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any, Final, Protocol

import click

from meshlet.api import wellknown
from meshlet.api.durations import parse_duration
from meshlet.api.hostport import HostPort, parse_hostport
from meshlet.controlplane.supervise import Supervisor

EX_CONFIG: Final = 64  # sysexits EX_USAGE: bad configuration


def option(*decls: str, **attrs: Any) -> Callable[[Any], Any]:
    """A click option also read from `MESHLET_<FLAG>` (e.g. `--admin-addr` → MESHLET_ADMIN_ADDR)."""
    flag = next(d for d in decls if d.startswith("--"))
    envvar = wellknown.CONTROLLER_ENV_PREFIX + flag[2:].upper().replace("-", "_")
    return click.option(*decls, envvar=envvar, show_envvar=True, **attrs)


def parse_addr(value: str) -> HostPort:
    """`:8080`, `0.0.0.0:8080`, `[::]:8080` or `127.0.0.1:0` → (host, port)."""
    return parse_hostport(value, empty_host="0.0.0.0", port_zero=True)


class Addr(click.ParamType):  # type: ignore[type-arg]
    name = "[host]:port"

    def convert(self, value: Any, param: Any, ctx: Any) -> HostPort:
        if isinstance(value, tuple):
            return HostPort(*value)
        try:
            return parse_addr(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """`500ms`, `10s`, `2m`, `24h` → seconds."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


class Service(Protocol):
    supervisor: Supervisor

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def serve_until_signalled(service: Service, name: str) -> int:
    """Starts `service` (named `name` in logs), waits for SIGTERM or SIGINT, or for its
    supervisor to give up on a background task, then stops it; the exit code (1: gave up)."""
    await service.start()
    supervisor = service.supervisor
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, supervisor.stop)
    await supervisor.stopping.wait()
    if supervisor.failure is None:
        logging.getLogger(f"meshlet.controlplane.{name}").info("%s shutting down", name)
    await service.stop()
    return 0 if supervisor.failure is None else 1
