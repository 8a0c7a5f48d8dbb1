"""`meshlet-proxy`: the sidecar's entry point."""

from __future__ import annotations

import os
import sys

from meshlet.proxy import logs
from meshlet.proxy.identity import prestart

USAGE = """usage: meshlet-proxy
           run the proxy, configured from MESHLET_PROXY_* variables
       meshlet-proxy identity-init --dir DIR --name NAME
           make the proxy's key and CSR (the pre-start step)
"""
EX_CONFIG = 64


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["identity-init"]:
        prestart.main(args[1:])
        return
    if args[:1] in (["-h"], ["--help"]):
        from meshlet.proxy.config import defaults_table

        sys.stdout.write(USAGE + "\nsettings (environment, default):\n")
        for name, default in defaults_table():
            sys.stdout.write(f"  {name} [{default}]\n")
        return
    if args:
        sys.stderr.write(USAGE)
        sys.exit(EX_CONFIG)
    from meshlet.proxy.config import ConfigError, load

    try:
        config = load(os.environ)
    except ConfigError as exc:
        for problem in exc.problems:
            sys.stderr.write(f"meshlet-proxy: {problem}\n")
        sys.exit(EX_CONFIG)
    logs.setup(config.log, config.log_format)
    import uvloop

    from meshlet.proxy.app import ListenError, run

    try:
        code = uvloop.run(run(config))
    except ListenError as exc:
        sys.stderr.write(f"meshlet-proxy: {exc}\n")
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
