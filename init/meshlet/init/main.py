"""`meshlet-init`: compute the iptables plan, print it (--simulate) or apply it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from meshlet.api import wellknown
from meshlet.init.plan import InitConfig, PlanError, parse_ports, plan

EX_CONFIG = 64
RESTORE = {"legacy": "iptables-legacy-restore", "nft": "iptables-nft-restore"}
SAVE = {"legacy": "iptables-legacy-save", "nft": "iptables-nft-save"}


def _config(args: argparse.Namespace) -> InitConfig:
    errors = []
    inbound: tuple[str, ...] = ()
    outbound: tuple[str, ...] = ()
    try:
        inbound = parse_ports(args.inbound_ports_to_ignore)
    except PlanError as exc:
        errors.append(f"--inbound-ports-to-ignore: {exc}")
    try:
        outbound = parse_ports(args.outbound_ports_to_ignore)
    except PlanError as exc:
        errors.append(f"--outbound-ports-to-ignore: {exc}")
    for flag in ("incoming_proxy_port", "outgoing_proxy_port"):
        if not 1 <= getattr(args, flag) <= 65535:
            errors.append(f"--{flag.replace('_', '-')}: not in 1-65535")
    if errors:
        raise PlanError("; ".join(errors))
    fixed = (str(wellknown.PROXY_CONTROL_PORT), str(wellknown.PROXY_ADMIN_PORT))
    return InitConfig(
        inbound_port=args.incoming_proxy_port,
        outbound_port=args.outgoing_proxy_port,
        proxy_uid=args.proxy_uid,
        proxy_gid=args.proxy_gid,
        skip_inbound_ports=tuple(dict.fromkeys((*fixed, *inbound))),
        skip_outbound_ports=outbound,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="meshlet-init", description="Route the pod's TCP through its meshlet proxy."
    )
    parser.add_argument("--incoming-proxy-port", type=int, default=wellknown.PROXY_INBOUND_PORT)
    parser.add_argument("--outgoing-proxy-port", type=int, default=wellknown.PROXY_OUTBOUND_PORT)
    parser.add_argument("--proxy-uid", type=int, default=wellknown.PROXY_UID)
    parser.add_argument("--proxy-gid", type=int, default=None)
    parser.add_argument("--inbound-ports-to-ignore", default="", metavar="PORTS")
    parser.add_argument("--outbound-ports-to-ignore", default="", metavar="PORTS")
    parser.add_argument("--mode", choices=sorted(RESTORE), default="legacy")
    parser.add_argument("--simulate", action="store_true", help="print the plan, change nothing")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        sys.exit(EX_CONFIG if exc.code else 0)
    try:
        config = _config(args)
    except PlanError as exc:
        sys.stderr.write(f"meshlet-init: {exc}\n")
        sys.exit(EX_CONFIG)
    if args.simulate:
        print("\n".join(plan(config)))
        return
    restore, save = RESTORE[args.mode], SAVE[args.mode]
    if shutil.which(restore) is None:
        sys.stderr.write(f"meshlet-init: {restore} not found; install iptables\n")
        sys.exit(1)
    current = subprocess.run([save, "-t", "nat"], capture_output=True, text=True, check=True).stdout
    rules = "\n".join(plan(config, current)) + "\n"
    result = subprocess.run([restore, "--noflush"], input=rules, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(f"meshlet-init: {restore} failed: {result.stderr}\n{rules}")
        sys.exit(1)
    print(rules, end="")


if __name__ == "__main__":
    main()
