"""`meshlet demo` and `meshlet demo down`: the local mesh, from the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import click

from meshlet.cli import localmesh, options
from meshlet.cli.demo import drills, lock, topology
from meshlet.cli.demo.apps import app
from meshlet.cli.demo.topology import Mode

if TYPE_CHECKING:
    from rich.console import Console

    from meshlet.cli.demo.run import Demo, Options

NAME_ENV: Final = localmesh.NAME_ENV  # the local mesh a command means without --name


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    problem = topology.name_problem(value)
    if problem is not None:
        raise click.BadParameter(problem)
    return value


def name_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--name", default=topology.DEFAULT_NAME, show_default=True, envvar=NAME_ENV,
        callback=_name,
        help=f"{what} (${NAME_ENV}). Each local mesh has its own state folder, addresses"
        " and network names, so meshes of different names run side by side.",
    )  # fmt: skip


# Seconds a demo waits for the lock held by a test of the machine's network, or by another demo
# that is still building or removing (a running demo is an error at once).
LOCK_WAIT: Final = 300.0


def choose_mode(requested: str) -> tuple[Mode, str]:
    """The mode to run in, and why when it is loopback although netns was possible to ask."""
    if requested == "loopback":
        return Mode.LOOPBACK, "asked for"
    problem = None
    if os.geteuid() != 0:
        problem = "not root"
    elif shutil.which("ip") is None:
        problem = "iproute2 (`ip`) is not installed"
    elif shutil.which("iptables-legacy-restore") is None:
        problem = "iptables is not installed"
    else:
        probe = topology.NETNS_PREFIX + f"probe-{os.getpid()}"  # its own: others may probe too
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            problem = f"network namespaces cannot be made here ({made.stderr.strip()})"
        else:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if problem is None:
        return Mode.NETNS, ""
    if requested == "netns":
        raise click.UsageError(f"--mode netns: {problem}")
    return Mode.LOOPBACK, problem


@click.group(invoke_without_command=True)
@click.option(
    "--duration",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="Seconds to run once the load starts, then summarize and clean up (0: until Ctrl-C).",
)
@click.option(
    "--rate", type=click.FloatRange(min=0.1, max=500), default=20.0, show_default=True,
    help="Calls per second the load generator makes to web.",
)  # fmt: skip
@click.option(
    "--drill", type=click.Choice(drills.DRILLS), help="A failure to stage during the run."
)
@click.option(
    "--mode",
    type=click.Choice(["auto", "netns", "loopback"]),
    default="auto",
    show_default=True,
    help="netns: pods as network namespaces with iptables (needs root); loopback: pods on "
    "127.N.77.x calling their proxies explicitly; auto: netns when possible.",
)
@click.option(
    "--issuance-lifetime",
    default=None,
    help="Lifetime of the proxies' certificates, e.g. 24h or 20s (default 24h; 20s with "
    "--drill restart-identity, so that renewals happen during the run).",
)
@click.option(
    "--keep", is_flag=True, help="Leave the mesh running at the end; `meshlet demo down` stops it."
)
@name_option("The local mesh's name")
@click.option(
    "--summary-json",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the final summary, as JSON, to this file.",
)
@click.option(
    "--cluster", is_flag=True,
    help="Run the demo application on the Kubernetes cluster of the kubeconfig, where meshlet"
    " is installed, instead of on this machine.",
)  # fmt: skip
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
              help="With --cluster. Default: $KUBECONFIG or ~/.kube/config.")  # fmt: skip
@click.option("--context", help="With --cluster: the kubeconfig context to use.")
@click.option(
    "--image",
    help="With --cluster: the demo apps' image (default: the installed controller's, with"
    " demo for controller).",
)
@options.control_plane_namespace(help="With --cluster: where meshlet is installed"
                                       f" (${options.NAMESPACE_ENV}).")  # fmt: skip
@click.pass_context
def demo(
    ctx: click.Context,
    duration: float,
    rate: float,
    drill: str | None,
    mode: str,
    issuance_lifetime: str | None,
    keep: bool,
    name: str,
    summary_json: Path | None,
    cluster: bool,
    kubeconfig: Path | None,
    context: str | None,
    image: str | None,
    control_plane_namespace: str,
) -> None:
    """Run a meshed application on this machine and watch the mesh work.

    As root, every pod is a network namespace on a bridge whose TCP goes through its own
    meshlet-proxy by iptables (meshlet-init); the control plane (destination, identity, policy,
    tap) runs beside them. The application: a load generator calling web (HTTP/1.1), which
    calls api (gRPC, three replicas, api-3 50 ms slower) and store (a server-speaks-first TCP
    protocol on an opaque port). An HTTPRoute sends 10 % of api's calls to its canary, api-v2;
    the api Service's annotations set a timeout, retries and failure accrual. Every call
    crosses the mesh over mutual TLS (in loopback mode the store is called directly); the
    screen shows what the proxies report, refreshed every second. Everything made is removed
    at the end. One mesh of a name runs at a time; meshes of different names (--name) run side
    by side, each in a place of its own (addresses 10.77.16N.0/20 or 127.N.77.0/24, bridge
    meshletN, namespaces meshletN-<pod>, state in /run/meshlet-demo-<name>, for the first free
    N from 1; the default mesh, demo, is N=0 with 10.77.0.0/20, 127.0.77.0/24, meshlet-<pod>
    and /run/meshlet-demo). Each holds a lock while it builds, runs and removes
    (/tmp/meshlet-demo.lock for the default), and waits for it while a test holds it.

    \b
    Drills (--drill; the fault at 30 % of --duration, the repair at 60 %):
      kill-destination  the destination killed, later restarted
      kill-replica      api-2's proxy and app killed
      restart-identity  the identity service killed, later restarted
      slow-replica      api-1 200 ms slower, later fast again
      deny              a client with api's identity tries store (netns mode only)
      canary            api's route weights 90/10 -> 50/50 -> 0/100 (api/api-v2), live
      failing-replica   api-2 answers INTERNAL to everything until the repair: the
                        breaker ejects it and the success rate recovers
    """
    if ctx.invoked_subcommand is not None:
        return
    from meshlet.api.durations import parse_duration
    from meshlet.cli.demo.run import Demo, DemoError, Options, exit_status, reserved_slots

    if cluster:
        local = {"--mode": mode != "auto", "--issuance-lifetime": issuance_lifetime is not None,
                 "--name": name != topology.DEFAULT_NAME}  # fmt: skip
        for option in (option for option, given in local.items() if given):
            raise click.UsageError(f"{option} is for the local mesh, not for --cluster")
        _on_cluster(
            Options(mode=Mode.CLUSTER, duration=duration, rate=rate, drill=drill, keep=keep,
                    issuance_lifetime="", summary_json=summary_json),
            kubeconfig, context, image, control_plane_namespace,
        )  # fmt: skip
        return
    for option, value in (("--kubeconfig", kubeconfig), ("--context", context), ("--image", image)):
        if value is not None:
            raise click.UsageError(f"{option} goes with --cluster")

    if issuance_lifetime is None:
        issuance_lifetime = drills.SHORT_LIFETIME if drill == "restart-identity" else "24h"
    try:
        parse_duration(issuance_lifetime)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--issuance-lifetime") from None
    chosen, why = choose_mode(mode)
    problem = drills.unavailable(drill, chosen)
    if problem is not None:
        raise click.UsageError(f"{problem} (this run: loopback mode, {why})")
    console = _console()
    if chosen is Mode.LOOPBACK:
        console.print(
            f"[yellow]loopback mode ({why}): no transparent interception: apps call their"
            " proxies explicitly and the store (opaque TCP) directly; run as root for the"
            " full mesh[/yellow]"
        )
    options = Options(
        mode=chosen, duration=duration, rate=rate, drill=drill, keep=keep,
        issuance_lifetime=issuance_lifetime, summary_json=summary_json,
    )  # fmt: skip
    try:
        with lock.claimed(name, LOCK_WAIT, reserved_slots,
                          busy=lambda: _busy(console, name)) as place:  # fmt: skip
            runner = Demo(options, console, place)
            logs = _run(runner, console, keep)
    except (DemoError, lock.LockBusy) as exc:
        raise click.ClickException(str(exc)) from None
    if runner.died:
        for proc in runner.died:
            console.print(
                f"[red]{proc.name} ended unexpectedly ({exit_status(proc)});"
                f" its log: {logs / proc.log.name}[/red]",
                soft_wrap=True,
            )
        sys.exit(1)


def _console() -> Console:
    from rich.console import Console

    # Not a terminal (`make demo | tee log`): rich would assume 80 columns and fold the tables.
    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)


def _on_cluster(
    options: Options,
    kubeconfig: Path | None,
    context: str | None,
    image: str | None,
    control_ns: str,
) -> None:
    """The demo application on the cluster, shown until the duration ends or Ctrl-C; then its
    namespace deleted (unless --keep)."""
    from meshlet.cli.cluster import api_client
    from meshlet.cli.demo.oncluster import ClusterDemo
    from meshlet.cli.demo.run import DemoError

    console = _console()
    runner = ClusterDemo(options, console, api_client(kubeconfig, context), control_ns, image)
    try:
        with console.status(f"applying the demo to namespace {topology.NAMESPACE}, waiting for"
                            " its pods…"):  # fmt: skip
            runner.up()
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        runner.run()
    finally:
        if options.keep:
            runner.keep()
        else:
            with console.status(f"deleting namespace {topology.NAMESPACE}…"):
                problems = runner.down()
            for problem in problems:
                console.print(f"[red]could not delete: {problem}[/red]")
            if not problems:
                console.print(f"deleted namespace {topology.NAMESPACE} and everything in it")


def _busy(console: Console, name: str) -> None:
    """Another process holds the lock of the mesh `name`: a running demo is an error at once
    (waiting for it could take for ever); a test, or a demo still building or removing, is
    waited for."""
    from meshlet.cli.demo.run import DemoError, running_demo
    from meshlet.cli.demo.supervisor import state_root

    running = running_demo(state_root(name))
    if running is not None:
        raise DemoError(running)
    console.print(
        f"waiting for {lock.name_file(name)} (up to {LOCK_WAIT:g}s): another demo of this"
        " name, or a test, holds it"
    )


def _run(runner: Demo, console: Console, keep: bool) -> Path:
    """Builds, runs and (unless `keep`) takes down the mesh, under the demo's lock; where the
    logs are."""
    with console.status("building the mesh: CA, control plane, pods, proxies…"):
        runner.up()
    try:
        runner.run()
    finally:
        logs = runner.keep_logs() if runner.died and not keep else runner.root / "logs"
        if keep:
            runner.keep()
        else:
            with console.status("removing everything the demo made…"):
                problems = runner.down()
            for problem in problems:
                console.print(f"[red]could not remove: {problem}[/red]")
            if not problems:
                console.print("removed every namespace, link, rule, file and process it made")
    return logs


@demo.command()
@click.option("--cluster", is_flag=True,
              help="The demo on the kubeconfig's cluster: delete its namespace.")  # fmt: skip
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
              help="With --cluster. Default: $KUBECONFIG or ~/.kube/config.")  # fmt: skip
@click.option("--context", help="With --cluster: the kubeconfig context to use.")
@name_option("The local mesh to stop")
def down(cluster: bool, kubeconfig: Path | None, context: str | None, name: str) -> None:
    """Stop a demo left running with --keep and remove everything it made; other local meshes
    (other --name) are left alone."""
    from meshlet.cli.demo.run import undo

    if cluster:
        from meshlet.cli.cluster import api_client
        from meshlet.cli.demo.oncluster import delete_namespace

        if name != topology.DEFAULT_NAME:
            raise click.UsageError("--name is for a local mesh, not for --cluster")

        problems = delete_namespace(api_client(kubeconfig, context))
        for problem in problems:
            click.echo(f"could not delete: {problem}", err=True)
        if problems:
            sys.exit(1)
        click.echo(f"deleted namespace {topology.NAMESPACE} (or there was none)")
        return
    from meshlet.cli.demo.supervisor import Record, records, state_root

    record = Record.load(state_root(name))
    if record is None:
        others = sorted(r.name for r in records())
        more = f" (there are: {', '.join(others)})" if others else ""
        click.echo(f"no demo called {name} is running{more}")
        return
    problems = undo(record)
    for problem in problems:
        click.echo(f"could not remove: {problem}", err=True)
    if problems:
        sys.exit(1)
    click.echo("stopped the demo and removed everything it made")


demo.add_command(app)
