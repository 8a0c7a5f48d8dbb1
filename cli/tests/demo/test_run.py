"""`meshlet demo` as a user runs it: the real command, real namespaces, iptables, processes.

Each test runs the demo for a while (with a drill or not), reads its summary (`--summary-json`,
the numbers the screen shows) and checks that nothing it made is left on the machine."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshlet.cli.demo import lock, network, topology
from meshlet.cli.demo.supervisor import shm_folder, state_root

# Each test runs the whole local mesh; `make test` runs them beside the rest of the suite.
pytestmark = pytest.mark.demo


def _demo_netns() -> frozenset[str]:
    """The default mesh's namespaces (other slots' are other meshes', made by other tests at
    the same time: a test of named meshes checks its own)."""
    return frozenset(m.netns for m in network.members(topology.layout(topology.Mode.NETNS)))


def _demo_link(name: str) -> bool:
    place = topology.DEFAULT_PLACE
    return name == place.bridge or name.startswith(place.veth_prefix)


NETNS = topology.layout(topology.Mode.NETNS)  # the default mesh's


@dataclass(frozen=True)
class MachineState:
    """What the demo could leave behind: its namespaces and links (by the names it gives them:
    other tests make theirs at the same time), the host's rules, its files, and meshlet
    processes descending from this test process."""

    netns: frozenset[str]
    links: frozenset[str]
    iptables: str
    etc_netns: bool
    files: frozenset[str]
    processes: frozenset[int]

    @classmethod
    def read(cls) -> MachineState:
        def out(*argv: str) -> str:
            return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

        files = {shm_folder(), str(state_root())}  # the default mesh's
        files = {path for path in files if Path(path).exists()}
        return cls(
            netns=frozenset(line.split()[0] for line in out("ip", "netns", "list").splitlines())
            & _demo_netns(),
            links=frozenset(p.name for p in Path("/sys/class/net").iterdir() if _demo_link(p.name)),
            iptables=out("iptables-legacy-save") + out("iptables-nft-save"),
            etc_netns=Path("/etc/netns").exists(),
            files=frozenset(files),
            processes=frozenset(_meshlet_processes()),
        )  # fmt: skip


PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(autouse=True, scope="module")
def _subreaper() -> None:
    """Processes the demo leaves behind are re-parented to this test process (not to init),
    so that the leak check counts the demo's own and never another program's on the machine."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _meshlet_processes() -> set[int]:
    """Live meshlet processes descending from this test process."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            commands[int(proc.name)] = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    ours = {os.getpid()}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    # zombies have an empty command line: reaped or not, they are not running
    return {pid for pid in ours - {os.getpid()} if b"meshlet" in commands.get(pid, b"")}


def _counters(iptables_save: str) -> str:
    """iptables-save output without its packet counters and timestamps."""
    lines = []
    for line in iptables_save.splitlines():
        if line.startswith("#"):
            continue
        if line.startswith(":"):
            line = line.split(" [", 1)[0]
        lines.append(line)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def _no_kept_demo(netns_available: None) -> None:
    """A demo kept by an earlier run that was killed before its `demo down` (a CI job stopped
    halfway) is removed first, as its user would, so that this module measures only itself."""
    down = subprocess.run([sys.executable, "-m", "meshlet.cli.main", "demo", "down"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture
def machine_unchanged(_no_kept_demo: None) -> Iterator[None]:
    """Fails the test if the machine's namespaces, links, rules, files or processes differ
    from what they were before it. The test holds the demo's lock from the first look to the
    last (its demo runs under it: the lock is its caller's), so that no test of the machine's
    network, in the other lane of `make test`, runs in between."""
    with lock.held(120.0):
        before = MachineState.read()
        yield
        after = MachineState.read()
    assert after.netns == before.netns
    assert after.links == before.links
    assert _counters(after.iptables) == _counters(before.iptables)
    assert after.etc_netns == before.etc_netns
    assert after.files == before.files
    assert after.processes <= before.processes, after.processes - before.processes


@pytest.fixture
def run_demo(machine_unchanged: None, tmp_path: Path) -> Any:

    def run(*args: str, duration: float, output: list[str] | None = None) -> dict[str, Any]:
        """The run's summary; its screen (stdout: no terminal, so plain snapshots) is appended
        to `output` when given."""
        summary = tmp_path / "summary.json"
        # The full view, whatever terminal the suite runs in (a COLUMNS under 120 would give
        # the compact one, in other words).
        env = {**os.environ, "COLUMNS": "160"}
        result = subprocess.run(
            [sys.executable, "-m", "meshlet.cli.main", "demo", "--mode", "netns",
             "--duration", str(duration), "--summary-json", str(summary), *args],
            capture_output=True, text=True, timeout=duration + 90, check=False, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "removed every namespace, link, rule, file and process it made" in result.stdout
        if output is not None:
            output.append(result.stdout)
        data: dict[str, Any] = json.loads(summary.read_text())
        return data

    return run


def layout_identity(pod: str) -> str:
    return topology.layout(topology.Mode.NETNS).pod(pod).identity


def _tap_event(tap: subprocess.Popen[str], client_id: str, within: float = 15.0) -> Any:
    """The first tap event of a request to web from `client_id` (the load keeps calling)."""
    assert tap.stdout is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = tap.stdout.readline()
        if not line:
            return None
        event = json.loads(line)
        if json.dumps(event).find(client_id) >= 0:
            return event
    return None


@pytest.mark.netns
def test_keep_leaves_the_mesh_running_until_demo_down(machine_unchanged: None) -> None:
    """--keep: the mesh outlives the command and serves what it prints (a call to web from
    the load pod, through both proxies); `meshlet demo down` then removes all of it."""
    meshlet = [sys.executable, "-m", "meshlet.cli.main", "demo"]
    try:
        run = subprocess.run([*meshlet, "--mode", "netns", "--duration", "3", "--keep"],
                             capture_output=True, text=True, timeout=90, check=False)  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "stop it and remove everything: meshlet demo down" in run.stdout
        load = NETNS.netns("load-1")
        assert f"ip netns exec {load} curl -s http://web.demo/" in run.stdout
        call = subprocess.run(["ip", "netns", "exec", load, "curl", "-s", "-m", "5",
                               "http://web.demo/"],
                              capture_output=True, text=True, timeout=20, check=False)  # fmt: skip
        answer = json.loads(call.stdout)
        assert answer["web"] == "web-1" and answer["api"].startswith("api-"), answer
        # its tap controller, found by `meshlet viz tap` without a cluster: web's live requests
        tap = subprocess.Popen(
            [sys.executable, "-m", "meshlet.cli.main", "viz", "tap", "deploy/web", "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            seen = _tap_event(tap, layout_identity("load-1"))
        finally:
            tap.terminate()
            _, err = tap.communicate(timeout=10)
        assert seen is not None, err[-2000:]
        top = subprocess.run(
            [sys.executable, "-m", "meshlet.cli.main", "viz", "top", "deploy/web", "--duration",
             "3", "-o", "json"], capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert top.returncode == 0, top.stderr
        rows = {(r["source"], r["destination"], r["path"]): r for r in json.loads(top.stdout)}
        load_ip = topology.layout(topology.Mode.NETNS).pod("load-1").ip  # no labels: its IP
        assert rows.get((load_ip, "web-1", "/"), {}).get("count", 0) > 0, rows
    finally:
        down = subprocess.run([*meshlet, "down"], capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the demo and removed everything it made" in down.stdout


def _call_web(load_netns: str) -> dict[str, Any]:
    """web's answer to a call by name from a mesh's load pod, through both proxies."""
    call = subprocess.run(["ip", "netns", "exec", load_netns, "curl", "-s", "-m", "5",
                           "http://web.demo/"],
                          capture_output=True, text=True, timeout=20, check=False)  # fmt: skip
    assert call.returncode == 0, call.stderr
    answer: dict[str, Any] = json.loads(call.stdout)
    return answer


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.netns
def test_meshes_of_two_names_run_side_by_side_and_one_stops_alone(
    machine_unchanged: None,
) -> None:
    """Two `meshlet demo --keep --name …` started at once each take a place of their own (slot,
    addresses, bridge, namespaces, state folder) and each serves its own calls; `meshlet demo
    down --name` of one removes all of it and leaves every process, namespace and answer of
    the other as they were."""
    meshlet = [sys.executable, "-m", "meshlet.cli.main", "demo"]
    names = ("side-a", "side-b")
    env = {k: v for k, v in os.environ.items() if k != "MESHLET_DEMO"}
    try:
        starts = [subprocess.Popen([*meshlet, "--mode", "netns", "--name", name, "--duration",
                                    "2", "--keep"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env)
                  for name in names]  # fmt: skip
        outputs = [start.communicate(timeout=120)[0] for start in starts]
        for name, start, out in zip(names, starts, outputs, strict=True):
            assert start.returncode == 0, out[-3000:]
            assert f"stop it and remove everything: meshlet demo down --name {name}" in out
        records = [json.loads(Path(f"/run/meshlet-demo-{name}/state.json").read_text())
                   for name in names]  # fmt: skip
        places = [topology.Place(r["name"], r["slot"]) for r in records]
        assert [p.name for p in places] == list(names)
        assert places[0].slot != places[1].slot and 0 not in (places[0].slot, places[1].slot)
        layouts = [topology.layout(topology.Mode.NETNS, place) for place in places]
        loads = [layout.netns("load-1") for layout in layouts]
        for layout, load, out in zip(layouts, loads, outputs, strict=True):
            assert f"ip netns exec {load} curl -s http://web.demo/" in out
            assert f"http://{layout.pod('web-1').ip}:4191/metrics" in out
            assert _call_web(load)["web"] == "web-1"
        assert not set(network.existing_netns(places[0].netns_prefix)) & set(
            network.existing_netns(places[1].netns_prefix)
        )

        down = subprocess.run([*meshlet, "down", "--name", names[0]], capture_output=True,
                              text=True, timeout=60, check=False, env=env)  # fmt: skip
        assert down.returncode == 0, down.stdout + down.stderr
        assert not network.existing_netns(places[0].netns_prefix)
        assert not network.link_exists(places[0].bridge)
        assert not Path(records[0]["root"]).exists() and not Path(records[0]["shm"]).exists()
        # the other: every process it recorded runs, its network is whole, and it answers
        assert all(_alive(pid) for pid in records[1]["processes"].values())
        assert set(network.existing_netns(places[1].netns_prefix)) == set(records[1]["netns"])
        assert network.link_exists(places[1].bridge)
        answer = _call_web(loads[1])
        assert answer["web"] == "web-1" and answer["api"].startswith("api-"), answer
    finally:
        for name in names:
            subprocess.run([*meshlet, "down", "--name", name], capture_output=True, text=True,
                           timeout=60, check=False, env=env)  # fmt: skip
    for place, record in zip(places, records, strict=True):  # nothing of either is left
        assert not network.existing_netns(place.netns_prefix), place
        assert not network.link_exists(place.bridge), place
        assert not Path(record["root"]).exists() and not Path(record["shm"]).exists()
        assert not any(_alive(pid) for pid in record["processes"].values())


@pytest.mark.netns
@pytest.mark.parametrize("after", [1.0, 2.0])  # network and control plane, then pods starting
def test_ctrl_c_while_the_mesh_is_built_leaves_nothing(
    machine_unchanged: None, after: float
) -> None:
    """Interrupted at some point of the build (which takes about 3 s: CA, namespaces, control
    plane, six pods), the demo removes what it made, including processes that started as the
    interrupt arrived and were never recorded."""
    argv = [sys.executable, "-m", "meshlet.cli.main", "demo", "--mode", "netns", "--duration", "30"]

    # A test run started in the background (`make test`'s second lane) inherits SIGINT ignored,
    # and so would the demo: give it a terminal's.
    def as_from_a_terminal() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=as_from_a_terminal)  # fmt: skip
    state = Path("/run/meshlet-demo/state.json")
    deadline = time.monotonic() + 60
    while not state.exists():  # the build has begun (on a busy machine, imports take a while)
        assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()[0][-3000:]
        time.sleep(0.02)
    time.sleep(after)
    demo.send_signal(signal.SIGINT)
    out, _ = demo.communicate(timeout=60)
    # 130: interrupted while building (a run stopped by Ctrl-C ends 0, with its summary)
    assert demo.returncode == 130, out[-3000:]


@pytest.mark.netns
def test_the_demo_runs_a_meshed_application_store_refuses_an_intruder_and_all_is_removed(
    run_demo: Any,
) -> None:
    """The application meshed end to end, with the deny drill: a client in api-1's pod
    connects to store through api-1's proxy, with api's identity, 5 times a second for 6 s;
    store's proxy refuses every attempt and counts each denial under api's identity, while
    web's calls go on as before. (The other drills' runs show store denying nothing.)"""
    summary = run_demo("--drill", "deny", duration=20)
    client = summary["client"]
    assert client["failed"] == 0 and client["dropped"] == 0, (client, summary["events"])
    # 20 calls/s for 20 s, give or take the last ones; calls the generator could not send on
    # time (its own process paused on a busy machine: `late`) are not the mesh's, but a run
    # mostly paused shows nothing
    assert client["late"] <= 20 * 20 * 0.25, client
    assert client["ok"] >= (20 * 20 - client["late"]) * 0.9, client
    assert client["success_rate"] == 1.0
    after_warmup = summary["replicas_after_warmup"]
    slow = after_warmup[topology.SLOW_REPLICA]["share"]
    # well under the even third: peak-EWMA moves calls off the replica 50 ms slower (about 5 %
    # on a quiet machine; a busy one slows the others too, and it takes up to ~15 %)
    assert slow is not None and slow < 0.2, after_warmup
    assert summary["mtls_share"] == 1.0
    for name in ("web", "api", "store"):
        workload = summary["workloads"][name]
        assert workload["mtls"] == 1.0, (name, workload)
    layout = topology.layout(topology.Mode.NETNS)
    api, web = (layout.pod(p).identity for p in ("api-1", "web-1"))
    callers = {"web": ["load-1"], "api": ["web-1"], "store": ["api-1", "web-1"]}
    for name, pods in callers.items():  # the identities each server-side proxy verified
        assert summary["workloads"][name]["peers"] == sorted(layout.pod(p).identity for p in pods)
    assert summary["workloads"]["store"]["connections_per_s"] > 10  # opaque TCP, meshed too
    # An opaque port: no detection wait (that would be DETECT_TIMEOUT_SECONDS, 10 s); the
    # bound leaves room for a busy 2-core machine (~35 ms typical, 120 ms seen).
    assert client["store_first_byte_max_ms"] < 500
    # store's policy: the intruder refused every time, web allowed every time
    checks = summary["checks"]
    intruder = checks["intruder"]
    assert intruder["attempts"] >= 20, intruder  # 5/s from 6 s to 12 s of load
    assert intruder["refused"] == intruder["attempts"] and intruder["admitted"] == 0, intruder
    assert checks["store_denied"] == {api: intruder["refused"]}, checks
    assert checks["store_denied_during_drill"] > 0
    assert set(checks["store_allowed_by_identity_during_drill"]) == {web}, checks
    assert checks["load_failed_during_drill"] == 0
    assert checks["load_ok_during_drill"] >= 6 * 20 * 0.8, checks
    before, during = checks["store_allowed_per_s_before"], checks["store_allowed_per_s_during"]
    assert during > 0.8 * before, checks
    store = summary["workloads"]["store"]
    # each answered call opened one store connection; the last scrape may precede the last few
    assert store["allowed"] >= client["ok"] - 5, store
    assert store["denied"] == intruder["refused"] and store["denied_peers"] == [api]
    assert all(summary["workloads"][name]["denied"] == 0 for name in ("web", "api"))
    assert "deny drill:" in summary["caption"]
    # api's HTTPRoute: about 10 % of its calls to the canary, by web's proxy's count
    split = summary["outbound"]["requests"]
    assert 0.04 < split["api-v2"] / (split["api"] + split["api-v2"]) < 0.2, split
    assert summary["outbound"]["balancers"] == {"api": {"ready": 3, "pending": 0},
                                                "api-v2": {"ready": 1, "pending": 0}}  # fmt: skip


@pytest.mark.netns
def test_what_an_earlier_demo_left_is_removed_before_the_mesh_is_built(run_demo: Any) -> None:
    """A namespace of the demo's still named, with a process in it, and a veth of the demo's
    whose other end lives on in a namespace nobody can name (its process outlived `ip netns
    del`), with no record of either: the next demo removes them and builds (it failed at
    `ip link add mlv-load-1 ...: File exists`)."""
    api, load = NETNS.netns("api-2"), NETNS.netns("load-1")
    veth = topology.VETH_PREFIX + "load-1"

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)

    holders: list[subprocess.Popen[bytes]] = []
    try:
        for ns in (api, load):
            ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", load)
        for ns in (api, load):
            holders.append(subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"]))
            deadline = time.monotonic() + 10
            while not network.pids_in(ns):
                assert time.monotonic() < deadline, f"nothing runs in {ns}"
                time.sleep(0.02)
        ip("netns", "del", load)  # the name goes; its process keeps the namespace and the veth
        assert network.link_exists(veth)
        screen: list[str] = []
        summary = run_demo(duration=3, output=screen)
        assert f"removed what an earlier demo left: {api}, {veth}" in screen[0], screen[0][-3000:]
        assert summary["client"]["failed"] == 0, summary["client"]
        assert holders[0].wait(timeout=10) is not None  # the process in api-2's namespace
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        subprocess.run(["ip", "netns", "del", api], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)


@pytest.mark.netns
def test_kill_destination_costs_no_call_and_updates_resume(run_demo: Any) -> None:
    # 30 s: the destination comes back at 18 s, leaving its streams time to reopen and the
    # update to be seen on a busy machine (20 s left 8, which one busy run did not meet)
    summary = run_demo("--drill", "kill-destination", duration=30)
    checks = summary["checks"]
    assert summary["client"]["failed"] == 0, summary["client"]
    assert checks["destination_back_at"] > checks["destination_killed_at"]
    assert checks["resubscribed_after_s"] < 10  # every stream reopened (jittered backoff)
    # once back, it took api-1 out of the endpoints: the proxies saw that update
    assert checks["api-1_calls_after_update"] == 0, checks
    assert checks["api_calls_after_update"] > 0


@pytest.mark.netns
def test_kill_replica_moves_the_traffic_and_fails_only_calls_in_flight(run_demo: Any) -> None:
    screen: list[str] = []
    summary = run_demo("--drill", "kill-replica", duration=16, output=screen)
    checks = summary["checks"]
    # on screen (a view every 10 s without a terminal): api-2 marked gone, not frozen at its rate
    assert re.search(r"^api-2 +- +- +- +- +gone: no metrics for \d+ s \(killed\)", screen[0],
                     re.MULTILINE), screen[0][-3000:]  # fmt: skip
    assert checks["failed_during_drill"] <= 3, summary["client"]
    calls = checks["calls_after_kill"]  # from 3 s after it left the endpoints to the end
    assert calls.get("api-2", 0) == 0
    assert calls.get("api-1", 0) + calls.get("api-3", 0) > 30


@pytest.mark.netns
def test_restart_identity_then_the_next_renewal_succeeds(run_demo: Any) -> None:
    screen: list[str] = []
    summary = run_demo("--drill", "restart-identity", "--issuance-lifetime", "20s", duration=30,
                       output=screen)  # fmt: skip
    renewed = summary["checks"]["renewed_after_restart"]
    assert renewed and all(renewed.values()), (renewed, summary["certificates"])
    pods = len(renewed)
    assert f"renewed since identity came back: {pods}/{pods}" in screen[0], screen[0][-3000:]
    assert summary["client"]["failed"] == 0


@pytest.mark.netns
def test_slow_replica_loses_its_traffic_while_slow(run_demo: Any) -> None:
    summary = run_demo("--drill", "slow-replica", duration=20)
    share = summary["checks"]["api-1_share_while_slow"]
    assert share is not None and share < 0.15, summary["checks"]
    assert summary["client"]["failed"] == 0
    # no intruder in this run: store's policy admits all of its callers (web)
    store = summary["workloads"]["store"]
    assert store["allowed"] > 0 and store["denied"] == 0, store


@pytest.mark.netns
def test_canary_drill_moves_the_split_with_the_routes_weights(run_demo: Any) -> None:
    """api's HTTPRoute rewritten 90/10 → 50/50 → 0/100 in the manifests while the load runs:
    the callers' proxies follow each step within SETTLE seconds, by their own route-backend
    counters and by who answered the load's calls; no call fails."""
    screen: list[str] = []
    summary = run_demo("--drill", "canary", duration=18, output=screen)
    steps = {step["weights"]: step for step in summary["checks"]["canary_steps"]}
    assert list(steps) == ["90/10", "50/50", "0/100"], steps
    for weights, low, high in (("90/10", 0.02, 0.25), ("50/50", 0.3, 0.7)):
        step = steps[weights]
        assert sum(step["requests"].values()) > 50, step  # ~5.4 s and ~3.4 s of 20 calls/s
        assert low < step["canary_share"] < high, step
        assert low < step["canary_share_by_client"] < high, step
    promoted = steps["0/100"]
    assert promoted["requests"].get("api", 0) == 0 and promoted["requests"]["api-v2"] > 60
    assert promoted["answered_by"]["api-v2-1"] > 60
    assert all(n == 0 for pod, n in promoted["answered_by"].items() if pod != "api-v2-1")
    assert summary["client"]["failed"] == 0, summary["client"]
    assert re.search(r"canary drill: api-v2 got [\d.]+% at 90/10, [\d.]+% at 50/50, 100\.0% at"
                     r" 0/100", summary["caption"]), summary["caption"]  # fmt: skip
    # on screen (each event as a line without a terminal): each change, and the share since
    for weights in ("50/50", "0/100"):
        assert re.search(rf"^\d\d:\d\d api-split at {weights}: api-v2 took \d+% of api's \d+ calls",
                         screen[0], re.MULTILINE), screen[0][-3000:]  # fmt: skip


@pytest.mark.netns
def test_failing_replica_is_ejected_and_the_success_rate_recovers(run_demo: Any) -> None:
    """api-2 answers INTERNAL to every call from 30 % to 60 % of the run: its failures reach
    the client (not retried: an HTTPRoute reads only HTTP retry conditions) until the
    breaker's 7 in a row eject it; then only its probes fail, and after the repair a probe
    succeeds and it returns."""
    screen: list[str] = []
    summary = run_demo("--drill", "failing-replica", duration=24, output=screen)
    checks = summary["checks"]
    assert checks["success_before"] == 1.0, checks
    # ejected while it fails, from 30 % to 60 % of the run (on a quiet machine ~2-4 s after
    # it began failing: 7 failures in a row, seen at the callers' next scrape)
    window = 0.3 * 24
    assert checks["ejected_after_s"] is not None and checks["ejected_after_s"] < window, checks
    assert checks["api_pending_max"] == 1.0  # one endpoint ejected, of api's three
    assert checks["success_until_ejected"] < 0.95, checks  # at least 7 failures in ~2 s
    # ejected: only the probes fail (a penalty of 1 s, then 2, 4, 5 s)
    assert checks["calls_while_ejected"] > 60 and checks["failed_while_ejected"] <= 4, checks
    assert checks["success_while_ejected"] >= 0.95, checks
    assert checks["restored_after_s"] is not None, checks  # within the 5 s max penalty (+50 %)
    assert checks["success_after_repair"] == 1.0, checks
    assert summary["client"]["failures"].keys() <= {"http 502"}, summary["client"]
    assert "failing-replica drill: client success 100.0% before" in summary["caption"]
    # on screen (each event as a line without a terminal): the ejection, then the return
    assert re.search(r"^\d\d:\d\d api's balancer: 2 ready, 1 pending: api-2 ejected [\d.]+ s",
                     screen[0], re.MULTILINE), screen[0][-3000:]  # fmt: skip
    assert re.search(r"^\d\d:\d\d api's balancer: api-2 back [\d.]+ s after the repair",
                     screen[0], re.MULTILINE), screen[0][-3000:]  # fmt: skip


@pytest.mark.netns
@pytest.mark.parametrize("component", ["identity", "policy"])
def test_a_component_that_dies_unexpectedly_fails_the_run_and_keeps_its_log(
    machine_unchanged: None, tmp_path: Path, component: str
) -> None:
    """A control-plane process killed from outside (no drill does that): the run goes on to its
    end, then says what died, keeps the logs, removes the rest and exits 1."""
    summary = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "meshlet.cli.main", "demo", "--mode", "netns",
            "--duration", "8", "--summary-json", str(summary)]  # fmt: skip
    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = Path("/run/meshlet-demo/state.json")
    deadline = time.monotonic() + 90
    while True:  # until the load runs: the mesh is up
        assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()[0][-3000:]
        with contextlib.suppress(OSError, ValueError):
            processes = json.loads(state.read_text())["processes"]
            if "app-load-1" in processes:
                break
        time.sleep(0.1)
    os.kill(processes[component], signal.SIGKILL)
    out, _ = demo.communicate(timeout=90)
    assert demo.returncode == 1, out[-3000:]
    assert "removed every namespace, link, rule, file and process it made" in out
    kept = re.search(rf"{component} ended unexpectedly \(killed by SIGKILL\); its log: (\S+)", out)
    assert kept is not None, out[-3000:]
    log = Path(kept.group(1))
    try:
        assert f"{component} serving on" in log.read_text()
    finally:
        shutil.rmtree(log.parent)
    data = json.loads(summary.read_text())
    assert data["died"] == {component: "killed by SIGKILL"}
    assert data["caption"].startswith(f"FAILED: {component} (killed by SIGKILL)")


def test_loopback_mode_runs_the_same_application_without_root_powers(tmp_path: Path) -> None:
    """Pods on 127.0.77.x, apps calling their proxies explicitly: no namespace, no rule. Kept
    (--keep), it says how to call web, and that command works until `demo down`."""
    summary_file = tmp_path / "summary.json"
    before = MachineState.read()
    meshlet = [sys.executable, "-m", "meshlet.cli.main"]
    result = subprocess.run(
        [*meshlet, "demo", "--mode", "loopback", "--duration", "8", "--keep",
         "--summary-json", str(summary_file)],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    try:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "loopback mode" in result.stdout and "transparent interception" in result.stdout
        said = re.search(r"call web through load-1's proxy: +(curl .*)$", result.stdout,
                         re.MULTILINE)  # fmt: skip
        assert said is not None, result.stdout[-3000:]
        call = subprocess.run(["sh", "-c", said.group(1)], capture_output=True, text=True,
                              timeout=20, check=False)  # fmt: skip
        assert call.returncode == 0 and json.loads(call.stdout)["web"], call
    finally:
        down = subprocess.run([*meshlet, "demo", "down"], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
    assert down.returncode == 0, down.stdout + down.stderr
    summary = json.loads(summary_file.read_text())
    assert summary["mode"] == "loopback"
    assert summary["client"]["failed"] == 0 and summary["client"]["ok"] > 100
    for name in ("web", "api"):  # the store is called directly in this mode
        assert summary["workloads"][name]["mtls"] == 1.0
    split = summary["outbound"]["requests"]  # the route applies to calls by authority too
    assert 0.02 < split["api-v2"] / (split["api"] + split["api-v2"]) < 0.25, split
    after = MachineState.read()
    assert after.files == before.files and after.netns == before.netns
    assert after.processes <= before.processes
