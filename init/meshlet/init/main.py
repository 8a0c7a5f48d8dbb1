"""`meshlet-init [apply] | cleanup`: program a pod's nat table so its TCP goes through the proxy,
or remove exactly that; print the plan with --simulate."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, NoReturn

from meshlet.init import guard
from meshlet.init.changes import Applier, ApplyError, apply_steps, cleanup_steps, restore_lines
from meshlet.init.config import FLAGS, ConfigError, Mode, Settings, load
from meshlet.init.plan import plan

EX_OK: Final = 0
EX_FAILED: Final = 1  # the table could not be read or changed
EX_CONFIG: Final = 64  # sysexits EX_USAGE: bad configuration, nothing changed
EX_REFUSED: Final = 77  # sysexits EX_NOPERM: the machine's own network namespace, nothing changed

DESCRIPTION: Final = """\
Route a pod's TCP through its meshlet proxy: incoming TCP to the proxy's inbound port, outgoing
TCP to its outbound port, except the proxy's own connections, loopback, and what is ignored below.
Every rule is in the nat table, in the chains PROXY_INIT_REDIRECT (jumped to from PREROUTING) and
PROXY_INIT_OUTPUT (from OUTPUT), commented meshlet-init/<purpose>. Running it again replaces the
rules; `meshlet-init cleanup` removes exactly them. Run it in the pod's network namespace: it
refuses the machine's own unless --force.
"""

EPILOG: Final = f"""\
exit codes:
  {EX_OK}   done
  {EX_FAILED}   the nat table could not be read or changed (the message says why)
  {EX_CONFIG}  bad flags or environment: every problem is named, nothing was changed
  {EX_REFUSED}  refused: this is the machine's own network namespace (or one that cannot be told
      apart from it); nothing was changed; --force overrides
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    cleanup = args.command == "cleanup"
    try:
        settings = load(_values(args, os.environ))
    except ConfigError as exc:
        problems = "".join(f"\n  {problem}" for problem in exc.problems)
        _exit(EX_CONFIG, f"bad configuration, nothing was changed:{problems}")
    if args.command == "check":
        _check(settings)
        return
    if settings.simulate and not cleanup:
        print("\n".join(plan(settings.config).lines()))
        if settings.ipv6 is not False:
            where = "" if settings.ipv6 else " (where the network namespace has IPv6)"
            print(f"# ip6tables{where}:")
            print("\n".join(plan(settings.config, ipv6=True).lines()))
        return
    if not settings.force and not settings.simulate:
        config = settings.config
        refused = guard.refusal(
            guard.read_facts(), cleanup, config.inbound_port, config.outbound_port
        )
        if refused:
            _exit(EX_REFUSED, refused)
    ipv6 = ipv6_on() if settings.ipv6 is None else settings.ipv6
    for family in (False, True) if ipv6 else (False,):
        table = "IPv6 nat table" if family else "nat table"
        try:
            applier = _applier(settings.mode, family)
            state = applier.state()
            steps = (
                cleanup_steps(state)
                if cleanup
                else apply_steps(plan(settings.config, family), state)
            )
            if settings.simulate:
                print(f"# meshlet-init cleanup would change the {table} ({applier.name}):")
                print("\n".join(restore_lines(steps)))
                continue
            if steps:
                applier.carry_out(steps)
        except ApplyError as exc:
            done = " (the IPv4 table is done: run it again)" if family else ""
            _exit(EX_FAILED, f"{exc}{done}")
        print(
            f"# meshlet-init {args.command}: {len(steps)} changes to the {table} ({applier.name})"
        )
        if steps:
            print("\n".join(restore_lines(steps)))
    if not ipv6 and not settings.simulate:
        why = "IPv6 is off in this network namespace" if settings.ipv6 is None else "--ipv6=false"
        print(f"# {why}: the IPv6 nat table is left as it is")


def _check(settings: Settings) -> None:
    """Reads the nat tables back (`iptables-save`, `ip6tables-save` where IPv6 is on) and
    compares them with the plan: what the CNI plugin's CHECK asks."""
    from meshlet.init.changes import differences
    from meshlet.init.restore import RestoreApplier
    from meshlet.init.save import parse_save

    ipv6 = ipv6_on() if settings.ipv6 is None else settings.ipv6
    problems = []
    for family in (False, True) if ipv6 else (False,):
        tool = f"{'ip6tables' if family else 'iptables'}-{settings.mode.value}"
        try:
            saved = parse_save(RestoreApplier(f"{tool}-save", f"{tool}-restore").saved())
        except (ApplyError, ValueError) as exc:
            _exit(EX_FAILED, str(exc))
        table = "IPv6 nat table" if family else "nat table"
        problems += [f"{table}: {p}" for p in differences(plan(settings.config, family), saved)]
    if problems:
        _exit(EX_FAILED, "the rules are not as planned: " + "; ".join(problems))
    print("# meshlet-init check: the rules are as planned")


def ipv6_on() -> bool:
    """Whether this network namespace has IPv6 (its /proc/sys/net is the namespace's own)."""
    try:
        return Path("/proc/sys/net/ipv6/conf/all/disable_ipv6").read_text().strip() == "0"
    except OSError:
        return False


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="meshlet-init",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument(
        "command",
        nargs="?",
        choices=("apply", "cleanup", "check"),
        default="apply",
        help="apply (the default) programs the rules; cleanup removes them; check exits 1,"
        " naming what differs, unless the tables hold the rules",
    )
    for flag in FLAGS:
        text = f"{flag.help} [env {flag.env}; default: {flag.default or 'none'}]"
        if flag.switch:
            result.add_argument(flag.option, action="store_const", const="true", help=text)
        else:
            result.add_argument(flag.option, metavar=flag.metavar, help=text)
    return result


def _applier(mode: Mode, ipv6: bool = False) -> Applier:
    """The applier of one family's nat table. IPv6's legacy table goes through
    ip6tables-legacy-restore: python-iptables keeps its xtables extensions per process for the
    first family it opened, so the same process cannot build IPv6 rules after IPv4's."""
    if mode is Mode.NFT or ipv6:
        from meshlet.init.restore import RestoreApplier

        tool = "ip6tables" if ipv6 else "iptables"
        return RestoreApplier(f"{tool}-{mode.value}-save", f"{tool}-{mode.value}-restore")
    from meshlet.init.legacy import IptcApplier

    return IptcApplier()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    try:
        return parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the problem
        sys.exit(EX_CONFIG if exc.code else EX_OK)


def _values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """Each flag's text: from the command line, else from its environment variable."""
    values = {}
    for flag in FLAGS:
        given = getattr(args, flag.name.replace("-", "_"))
        if given is not None:
            values[flag.name] = given
        elif flag.env in env:
            values[flag.name] = env[flag.env]
    return values


def _exit(code: int, message: str) -> NoReturn:
    sys.stderr.write(f"meshlet-init: {message}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
