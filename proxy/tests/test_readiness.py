"""`meshlet-proxy-await` as the kubelet runs it (the classic sidecar's postStart hook): the real
command against a real admin server that becomes ready later, and against nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from meshlet.api.admin import AdminServer
from meshlet_testing.sockets import free_port

AWAIT = str(Path(sys.executable).with_name("meshlet-proxy-await"))


async def test_it_returns_once_the_proxy_is_ready_and_fails_clearly_when_it_never_is() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/ready"
    is_ready = False
    admin = AdminServer(lambda: [], ready=lambda: is_ready)
    waiting = await asyncio.create_subprocess_exec(
        AWAIT, "--timeout=20", f"--url={url}", stderr=subprocess.PIPE
    )
    started = time.monotonic()
    await asyncio.sleep(0.5)  # nothing listens yet: it keeps trying
    await admin.start("127.0.0.1", port)
    try:
        await asyncio.sleep(0.5)  # listening, not ready (503): it keeps trying
        assert waiting.returncode is None
        is_ready = True
        assert await asyncio.wait_for(waiting.wait(), 10) == 0
        assert time.monotonic() - started < 5
    finally:
        await admin.close()
    never = await asyncio.create_subprocess_exec(
        AWAIT, "--timeout=1", f"--url={url}", stderr=subprocess.PIPE
    )
    _, err = await asyncio.wait_for(never.communicate(), 10)
    assert never.returncode == 1
    assert err.decode() == f"meshlet-proxy-await: {url} not ready after 1s\n"
