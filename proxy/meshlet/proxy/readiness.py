"""`meshlet-proxy-await`: waits until the pod's proxy is ready (its admin `/ready` answers 200),
Linkerd's `linkerd-await`. The injector runs it as the classic sidecar's postStart hook: the
kubelet starts a pod's containers in order and starts the next only once a container's
postStart hook has returned, so the app (after the proxy) starts with its traffic already
going somewhere. A native sidecar needs none of it: its startup probe holds the app back."""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Final

from meshlet.api import wellknown

URL: Final = f"http://127.0.0.1:{wellknown.PROXY_ADMIN_PORT}/ready"
EVERY: Final = 0.1  # seconds between attempts


def ready(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshlet-proxy-await", description=__doc__)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait at most (default 120); then exit 1")  # fmt: skip
    parser.add_argument("--url", default=URL, help=f"the proxy's readiness (default {URL})")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    while not ready(args.url, timeout=1.0):
        if time.monotonic() >= deadline:
            sys.stderr.write(f"meshlet-proxy-await: {args.url} not ready after {args.timeout:g}s\n")
            sys.exit(1)
        time.sleep(EVERY)


if __name__ == "__main__":
    main()
