"""`meshlet-proxy`: the sidecar's entry point."""

from __future__ import annotations

import sys

from meshlet.proxy.identity import prestart

USAGE = """usage: meshlet-proxy identity-init --dir DIR --name NAME

  identity-init   make the proxy's ECDSA P-256 key and CSR in DIR (the pre-start step)

The proxy's listeners and data path are not part of this build yet.
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["identity-init"]:
        prestart.main(args[1:])
        return
    sys.stderr.write(USAGE)
    sys.exit(0 if args[:1] in (["-h"], ["--help"]) else 64)


if __name__ == "__main__":
    main()
