"""Failure drills: what happens when, during a demo run (`schedule`, pure), doing it (`perform`),
and what the drill measured (`finish`), which the summary reports and the tests check.

Times count from the start of the load. With a duration D the fault comes at 0.3·D and is
repaired at 0.6·D; without one, at 10 s and 20 s.

- kill-destination: the destination process is killed (SIGKILL), then started again; once every
  proxy has opened its streams again (they reconnect with jittered backoff, up to 5 s apart),
  api-1 is taken out of the manifests. Proxies must keep serving from their last endpoints while
  it is down, and must see that update after it returns (api-1 then gets no new calls).
- kill-replica: api-2's proxy and app are killed; 2 s later api-2 leaves the manifests, as the
  endpoints controller would notice. Calls move to the other replicas; only those in flight fail.
- restart-identity: the identity service is killed, then started again; the proxies' next
  certificate renewal (a short issuance lifetime makes it come during the run) must succeed.
- slow-replica: api-1 becomes 200 ms slower (SIGUSR1 to its app), later fast again (SIGUSR2):
  the balancers move calls away from it, then back.
- deny: a client in api-1's pod (`meshlet demo app intruder`, beside the api app) connects to the
  store 5 times a second until the repair. The pod's rules send its connections through api-1's
  proxy, which opens them over mTLS with api's identity; the store's policy admits only web's,
  so the store's proxy refuses each one. Web's calls to the store go on as before. Netns mode
  only: in loopback mode nothing sends a connection to the store through a proxy.
- canary: api's HTTPRoute is rewritten in the manifests, 90/10 (api/api-v2) → 50/50 at the
  fault → 0/100 at the repair (the canary promoted); the policy controller streams each change
  to the callers' proxies. Each step's split is measured from the proxies' route-backend counters
  (and the load's own count of who answered) from SETTLE seconds after the change to the next.
- failing-replica: api-2 answers every call with INTERNAL (its fault flag exists) from the fault
  to the repair. The api Service's failure accrual ejects it from the callers' balancers after 7
  failures in a row (outbound_http_balancer_endpoints shows it pending), probes it with a single
  call after a penalty (1 s, doubling up to 5 s), and lets it back when a probe succeeds, after
  the repair. The load's success rate is measured before (over the load's last 30 s of calls
  before the fault, which is all it keeps), from the fault until the ejection is seen, while it
  is ejected, and after the repair.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.cli.demo import outbound, topology
from meshlet.cli.demo.apps import SLOW_DRILL_DELAY
from meshlet.cli.demo.supervisor import command
from meshlet.cli.stats import Scrape, traffic

DRILLS: Final = ("kill-destination", "kill-replica", "restart-identity", "slow-replica", "deny",
                  "canary", "failing-replica")  # fmt: skip
INTRUDER_POD: Final = "api-1"  # the deny drill's client: a pod the store's policy does not admit
INTRUDER_RATE: Final = 5.0  # its attempts per second
INTRUDER_STATS: Final = "intruder-stats.json"  # in the demo's state folder
# The issuance lifetime restart-identity uses unless one is given: renewals come at 70 % of
# the lifetime plus 20 s of skew, so within a run of 30 s or more.
SHORT_LIFETIME: Final = "20s"
SETTLE: Final = 2.0  # seconds for an update to reach every proxy before measuring after it
RESUBSCRIBE_WITHIN: Final = 15.0  # seconds the proxies get to reopen their discovery streams
CANARY_STEPS: Final = ((50, 50), (0, 100))  # api's route's weights at the fault, at the repair
FAILING_REPLICA: Final = "api-2"
WATCH_EVERY: Final = 1.0  # seconds between the failing-replica drill's looks at the balancers


@dataclass(frozen=True, slots=True)
class Step:
    at: float  # seconds after the load started
    action: str


def unavailable(drill: str | None, mode: topology.Mode) -> str | None:
    """Why `drill` cannot run in `mode`; None when it can."""
    if drill == "deny" and mode is topology.Mode.LOOPBACK:
        return (
            "--drill deny needs netns mode: in loopback mode the store is called directly, not"
            " through its proxy, so no policy can act on its connections; run it as root"
            " with --mode netns"
        )
    return None


def intruder_argv(stats_file: str) -> list[str]:
    """`meshlet demo app intruder …` (after the `meshlet` command): store by its name, which
    the pod's /etc/hosts maps to the store's cluster IP."""
    return ["demo", "app", "intruder", "--target", topology.service("store").authority,
            "--rate", str(INTRUDER_RATE), "--stats", stats_file]  # fmt: skip


def schedule(drill: str | None, duration: float) -> list[Step]:
    if drill is None:
        return []
    fault, repair = (0.3 * duration, 0.6 * duration) if duration else (10.0, 20.0)
    steps = {
        "kill-destination": [Step(fault, "kill destination"), Step(repair, "start destination")],
        "kill-replica": [Step(fault, "kill api-2"), Step(fault + 2.0, "remove api-2"),
                         Step(fault + SETTLE + 2.0, "mark after-kill")],
        "restart-identity": [Step(fault, "kill identity"), Step(repair, "start identity")],
        "slow-replica": [Step(fault, "slow api-1"), Step(fault + SETTLE, "mark slowed"),
                         Step(repair, "mark healed"), Step(repair, "heal api-1")],
        "deny": [Step(fault, "mark intruding"), Step(fault, f"intrude {INTRUDER_POD}"),
                 Step(repair, f"leave {INTRUDER_POD}"), Step(repair, "mark left")],
        "canary": [Step(at, "weigh {}/{}".format(*w))
                   for at, w in zip((fault, repair), CANARY_STEPS, strict=True)],
        "failing-replica": [Step(fault, "watch balancers"), Step(fault, f"fail {FAILING_REPLICA}"),
                            Step(repair, f"repair {FAILING_REPLICA}")],
    }[drill]  # fmt: skip
    return sorted(steps, key=lambda step: step.at)


def perform(step: Step, demo: Any) -> list[Step]:
    """Does `step` to a running `run.Demo`; the steps it leads to (to come later)."""
    sup = demo.sup
    verb, _, what = step.action.partition(" ")
    if verb == "kill" and what in ("destination", "identity"):
        if what == "destination":
            demo.checks["streams_before_kill"] = _destination_streams(demo)
        sup.kill(what)
        demo.checks[f"{what}_killed_at"] = time.time()
        demo._event(f"drill: {what} killed")
    elif verb == "start":
        demo._start_spec(what)
        port = {"destination": wellknown.DESTINATION_ADMIN_PORT,
                "identity": wellknown.IDENTITY_ADMIN_PORT}[what]  # fmt: skip
        sup.wait_ready(what, f"http://{demo.layout.control_ip}:{port}/ready", 30.0)
        demo.checks[f"{what}_back_at"] = time.time()
        demo._event(f"drill: {what} back")
        if what == "destination":
            return [Step(step.at + 0.5, "await resubscribed")]
    elif verb == "await":  # every proxy's discovery streams open again?
        waited = time.time() - demo.checks["destination_back_at"]
        if _destination_streams(demo) < demo.checks["streams_before_kill"]:
            if waited < RESUBSCRIBE_WITHIN:
                return [Step(step.at + 0.5, step.action)]
            demo._event(f"proxies did not all reopen their streams within {waited:.0f}s")
        demo.checks["resubscribed_after_s"] = round(waited, 1)
        demo._event(f"proxies resubscribed {waited:.1f}s after the destination came back")
        # an update the proxies only see if discovery resumed
        demo._manifests().remove("pod-api-1")
        demo.removed.add("api-1")
        demo.notes["api-1"] = "removed from endpoints"
        demo._event("api-1 removed from the endpoints")
        return [Step(step.at + SETTLE, "mark after-update")]
    elif verb == "kill":  # a replica
        demo.checks["failed_before_kill"] = _failed(demo)
        for name in (f"proxy-{what}", f"app-{what}"):
            sup.kill(name)
        demo.notes[what] = "killed"
        demo._event(f"drill: {what} killed")
    elif verb == "remove":
        demo._manifests().remove(f"pod-{what}")
        demo.removed.add(what)
        demo._event(f"{what} removed from the endpoints")
    elif verb == "slow":
        sup.signal(f"app-{what}", signal.SIGUSR1)
        demo.notes[what] = "+200 ms (drill)"
        demo.slow[what] = SLOW_DRILL_DELAY * 1000
        demo._event(f"drill: {what} 200 ms slower")
    elif verb == "heal":
        sup.signal(f"app-{what}", signal.SIGUSR2)
        demo.notes[what] = "healed"
        demo.slow.pop(what, None)
        demo._event(f"drill: {what} fast again")
    elif verb == "intrude":
        stats = demo.root / INTRUDER_STATS
        stats.unlink(missing_ok=True)
        sup.start("intruder", [*command("meshlet"), *intruder_argv(str(stats))],
                  netns=demo.layout.netns(what))  # fmt: skip
        demo.notes[what] = "+ intruder → store"
        identity = demo.layout.pod(what).identity
        demo._event(f"drill: a client in {what} ({identity.split('.')[0]}'s identity) calls store")
    elif verb == "leave":
        sup.stop("intruder")
        demo.notes[what] = ""
        demo._event(f"drill: the client in {what} stopped")
    elif verb == "weigh":
        _weigh(demo, what)
        return [Step(step.at + SETTLE, f"mark settled {what}")]
    elif verb == "fail":
        flag = Path(topology.fault_flag(str(demo.root), demo.layout.pod(what)))
        flag.touch()
        demo.checks["failing_at"] = time.time()
        demo.notes[what] = "answers INTERNAL (drill)"
        demo._event(f"drill: {what} answers every call with INTERNAL")
    elif verb == "repair":
        Path(topology.fault_flag(str(demo.root), demo.layout.pod(what))).unlink(missing_ok=True)
        demo.checks["repaired_at"] = time.time()
        demo.notes[what] = "repaired"
        demo._event(f"drill: {what} answers normally again")
    elif verb == "watch":
        _watch_balancers(demo)
        return [Step(step.at + WATCH_EVERY, step.action)]
    elif verb == "mark":
        settled = what.startswith("settled ")
        _mark(demo, what, fresh=settled)
        if settled:
            _settled(demo, what.removeprefix("settled "))
    else:
        raise ValueError(f"unknown drill step {step.action!r}")
    return []


def _mark(demo: Any, name: str, fresh: bool = False) -> None:
    """Keeps the counters as they are now under `name`: every proxy's last scrape (`fresh`:
    scraped now rather than at the last refresh, up to a second ago) and the load's counts."""
    if fresh:
        demo._scrape_all()
    demo.checks.setdefault("marks", {})[name] = {
        "scrapes": {pod: history[-1] for pod, history in demo.scrapes.items() if history},
        "ok_by_api": _ok_by_api(demo),
        "failed": _failed(demo),
    }


def _weigh(demo: Any, weights: str) -> None:
    """Marks the end of the split so far, then writes api's route with the new weights
    (`50/50`: api's, then the canary's)."""
    api, canary = (int(w) for w in weights.split("/"))
    _mark(demo, f"before {weights}", fresh=True)
    demo.set_route(api, canary)
    demo.weights = {"api": api, topology.CANARY: canary}
    demo._event(f"drill: {topology.API_ROUTE} now weighs api {api}, {topology.CANARY} {canary}")


def _settled(demo: Any, weights: str) -> None:
    """An event with the canary's share of api's calls since the weights were written (which
    includes the time the change takes to reach the proxies)."""
    marks = demo.checks["marks"]
    before, now = marks.get(f"before {weights}"), marks[f"settled {weights}"]
    if before is None:
        return
    counts = outbound.split_between(before["scrapes"], now["scrapes"], "api")
    share = outbound.shares(counts).get(topology.CANARY, 0.0)
    demo._event(f"{topology.API_ROUTE} at {weights}: {topology.CANARY} took {share * 100:.0f}%"
                f" of api's {sum(counts.values()):.0f} calls in the {SETTLE:g} s since the"
                " change")  # fmt: skip


def _watch_balancers(demo: Any) -> None:
    """During the failing-replica drill, every WATCH_EVERY seconds: the api balancers' pending
    endpoints (from the callers' proxies' last scrapes), when the ejection was first seen, when
    the replica was back, and every call the load finished since the last look (to measure the
    success rate by phase: the load keeps its last 30 s)."""
    checks = demo.checks
    now = time.time()
    latest = [history[-1] for history in demo.scrapes.values() if history]
    api = outbound.balancers(latest).get("api")
    pending = api.pending if api is not None else 0.0
    checks["api_pending_max"] = max(checks.get("api_pending_max", 0.0), pending)
    failing, repaired = checks.get("failing_at"), checks.get("repaired_at")
    if failing is not None and api is not None and api.pending and "ejected_at" not in checks:
        checks["ejected_at"] = now
        demo.notes[FAILING_REPLICA] = "answers INTERNAL (drill) · ejected by the breaker"
        demo._event(f"api's balancer: {api.ready:.0f} ready, {api.pending:.0f} pending:"
                    f" {FAILING_REPLICA} ejected {now - failing:.1f} s after it began"
                    " failing")  # fmt: skip
    back = repaired is not None and "ejected_at" in checks and not pending
    if back and "restored_at" not in checks:
        checks["restored_at"] = now
        demo.notes[FAILING_REPLICA] = "back in the balancers"
        demo._event(f"api's balancer: {FAILING_REPLICA} back {now - repaired:.1f} s after the"
                    " repair, nothing pending")  # fmt: skip
    stats = demo._load_stats() or {}
    calls = _calls(demo)
    last = calls[-1][0] if calls else 0.0
    calls.extend(tuple(c) for c in stats.get("recent", []) if c[0] > last)


def _calls(demo: Any) -> list[tuple[float, str, str]]:
    """The load's calls the failing-replica drill has gathered: (end time, outcome, api pod)."""
    calls: list[tuple[float, str, str]] = demo.checks.setdefault("calls", [])
    return calls


def _destination_streams(demo: Any) -> float:
    """How many Get/GetProfile streams the destination serves now (0 when unreachable)."""
    from meshlet.cli.stats import parse

    url = f"http://{demo.layout.control_ip}:{wellknown.DESTINATION_ADMIN_PORT}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            series = parse(response.read().decode())
    except OSError:
        return 0.0
    return sum(v for (name, _), v in series.items() if name == "destination_streams_active")


def finish(demo: Any) -> dict[str, Any]:
    """What the drill measured, as plain values."""
    checks = demo.checks
    marks = checks.pop("marks", {})
    drill = demo.options.drill
    out: dict[str, Any] = {k: v for k, v in checks.items()}
    if drill == "kill-destination" and "after-update" in marks:
        out["api-1_calls_after_update"] = _requests_since(demo, marks["after-update"], "api-1")
        out["api_calls_after_update"] = sum(
            _requests_since(demo, marks["after-update"], p.name) for p in demo.layout.of("api")
        )
    if drill == "kill-replica":
        out["failed_during_drill"] = _failed(demo) - checks.get("failed_before_kill", 0)
        if "after-kill" in marks:  # the load's stats lag up to a second: count from the mark
            before = marks["after-kill"]["ok_by_api"]
            after = _ok_by_api(demo)
            out["calls_after_kill"] = {p: after.get(p, 0) - before.get(p, 0) for p in after}
    if drill == "slow-replica" and {"slowed", "healed"} <= marks.keys():
        slowed, healed = marks["slowed"]["scrapes"], marks["healed"]["scrapes"]
        counts = {
            p.name: traffic(slowed[p.name], healed[p.name]).requests
            for p in demo.layout.of("api") if p.name in slowed and p.name in healed
        }  # fmt: skip
        total = sum(counts.values())
        out["api-1_share_while_slow"] = counts.get("api-1", 0) / total if total else None
    if drill == "deny":
        out.update(_deny(demo, marks))
    if drill == "canary":
        out["canary_steps"] = _canary(demo, marks)
    if drill == "failing-replica":
        out.update(_failing(demo, out.pop("calls", [])))
    if drill == "restart-identity":
        back = checks.get("identity_back_at")
        certs = demo._certificates()
        out["renewed_after_restart"] = {
            pod: bool(back and c["refreshed_at"] > back and c["refreshes_ok"] >= 2)
            for pod, c in certs.items()
        }
    return out


def _deny(demo: Any, marks: dict[str, Any]) -> dict[str, Any]:
    """The intruder's own count, and the store's proxy's: denials by identity over the run and
    during the drill; connections allowed per second before and during it; the load's calls
    during it."""
    seen = demo.intruder_stats() or {"attempts": 0, "outcomes": {}}
    outcomes = dict(seen.get("outcomes", {}))
    pod = demo.layout.pod(INTRUDER_POD)
    out: dict[str, Any] = {
        "intruder": {
            "pod": pod.name,
            "identity": pod.identity,
            "attempts": int(seen.get("attempts", 0)),
            "refused": int(outcomes.pop("refused", 0)),
            "admitted": int(outcomes.pop("admitted", 0)),
            "other": outcomes,
        }
    }
    store = demo.layout.of("store")[0].name
    history = demo.scrapes.get(store)
    first = demo.start_scrape.get(store)
    if history and first is not None:
        whole = traffic(first, history[-1])
        out["store_denied"] = {peer: int(n) for peer, n in whole.denied_peers.items()}
        out["store_allowed"] = int(whole.allowed)
    if {"intruding", "left"} <= marks.keys() and first is not None:
        start = marks["intruding"]["scrapes"].get(store)
        end = marks["left"]["scrapes"].get(store)
        if start is not None and end is not None:
            before, during = traffic(first, start), traffic(start, end)
            out["store_denied_during_drill"] = int(during.denied)
            out["store_allowed_during_drill"] = int(during.allowed)
            out["store_allowed_by_identity_during_drill"] = {
                peer: int(n) for peer, n in during.allowed_peers.items()
            }
            out["store_allowed_per_s_before"] = (
                round(before.allowed / before.seconds, 2) if before.seconds else None
            )
            out["store_allowed_per_s_during"] = (
                round(during.allowed / during.seconds, 2) if during.seconds else None
            )
        out["load_failed_during_drill"] = marks["left"]["failed"] - marks["intruding"]["failed"]
        out["load_ok_during_drill"] = sum(marks["left"]["ok_by_api"].values()) - sum(
            marks["intruding"]["ok_by_api"].values()
        )
    return out


def _canary(demo: Any, marks: dict[str, Any]) -> list[dict[str, Any]]:
    """Each weighting's split, from SETTLE seconds after it was written (the load's start for
    the first) to the next change (the end for the last): requests per backend as the callers'
    proxies counted them, and calls per api pod as the load counted who answered."""
    now = {
        "scrapes": {pod: history[-1] for pod, history in demo.scrapes.items() if history},
        "ok_by_api": _ok_by_api(demo),
    }
    start = {"scrapes": dict(demo.start_scrape), "ok_by_api": {}}
    names = ["{}/{}".format(*w) for w in (topology.CANARY_WEIGHTS, *CANARY_STEPS)]
    out = []
    for i, weights in enumerate(names):
        begin = start if i == 0 else marks.get(f"settled {weights}")
        end = marks.get(f"before {names[i + 1]}") if i + 1 < len(names) else now
        if begin is None or end is None:
            continue
        requests = outbound.split_between(begin["scrapes"], end["scrapes"], "api")
        answered = {pod: n - begin["ok_by_api"].get(pod, 0)
                    for pod, n in end["ok_by_api"].items()}  # fmt: skip
        canary_pods = {p.name for p in demo.layout.of(topology.CANARY)}
        calls = sum(answered.values())
        out.append({
            "weights": weights,
            "requests": requests,
            "canary_share": outbound.shares(requests).get(topology.CANARY),
            "answered_by": answered,
            "canary_share_by_client": (
                sum(n for pod, n in answered.items() if pod in canary_pods) / calls
                if calls else None
            ),
        })  # fmt: skip
    return out


def _failing(demo: Any, calls: list[tuple[float, str, str]]) -> dict[str, Any]:
    """The load's success rate before the fault, from the fault until the ejection was seen,
    while the replica was ejected (until the repair), and after the repair; how long the
    ejection and the return took; what the replica answered while ejected."""
    checks = demo.checks
    end = time.time()
    load = end - (time.monotonic() - demo.load_started) if demo.load_started else end
    failing = checks.get("failing_at", end)
    ejected = checks.get("ejected_at")
    repaired = checks.get("repaired_at", end)
    out: dict[str, Any] = {
        "failing_replica": FAILING_REPLICA,
        "success_before": outbound.success(calls, load, failing),
        "success_until_ejected": outbound.success(calls, failing, ejected or repaired),
        "success_while_ejected": (
            outbound.success(calls, ejected, repaired) if ejected is not None else None
        ),
        "success_after_repair": outbound.success(calls, repaired, end),
        "ejected_after_s": round(ejected - failing, 1) if ejected is not None else None,
        "restored_after_s": (
            round(checks["restored_at"] - repaired, 1) if "restored_at" in checks else None
        ),
    }
    if ejected is not None:
        during = [outcome for at, outcome, _ in calls if ejected <= at < repaired]
        out["failed_while_ejected"] = sum(1 for outcome in during if outcome != "ok")
        out["calls_while_ejected"] = len(during)
    return out


def summary_line(drill: str | None, checks: dict[str, Any]) -> str:
    """The drill's result in the summary's caption ("" when it has none)."""
    if drill == "canary" and checks.get("canary_steps"):
        shares = [
            ("-" if s["canary_share"] is None else f"{s['canary_share'] * 100:.1f}%")
            + f" at {s['weights']}"
            for s in checks["canary_steps"]
        ]
        return f"; canary drill: {topology.CANARY} got " + ", ".join(shares)
    if drill == "failing-replica" and "success_before" in checks:

        def pct(key: str) -> str:
            value = checks.get(key)
            return "-" if value is None else f"{value * 100:.1f}%"

        ejected = checks.get("ejected_after_s")
        restored = checks.get("restored_after_s")
        return (
            f"; failing-replica drill: client success {pct('success_before')} before, "
            f"{pct('success_until_ejected')} until {FAILING_REPLICA} was ejected "
            f"({'never' if ejected is None else f'after {ejected:g} s'}), "
            f"{pct('success_while_ejected')} while ejected, {pct('success_after_repair')} "
            f"after the repair ({FAILING_REPLICA} "
            f"{'not back by the end' if restored is None else f'back {restored:g} s after it'})"
        )
    if drill != "deny" or "intruder" not in checks:
        return ""
    intruder = checks["intruder"]
    denied = sum(checks.get("store_denied", {}).values())
    return (
        f"; deny drill: {intruder['refused']} of {intruder['attempts']} attempts from "
        f"{intruder['pod']} refused, store's proxy denied {denied} and allowed "
        f"{checks.get('store_allowed_during_drill', '-')} meanwhile"
    )


def _failed(demo: Any) -> int:
    stats = demo._load_stats() or {}
    return int(sum(stats.get("failed", {}).values()))


def _ok_by_api(demo: Any) -> dict[str, int]:
    stats = demo._load_stats() or {}
    return dict(stats.get("by_api", {}))


def _requests_since(demo: Any, mark: dict[str, Any], pod: str) -> float:
    old: Scrape | None = mark["scrapes"].get(pod)
    history = demo.scrapes.get(pod)
    if old is None or not history:
        return 0.0
    return traffic(old, history[-1]).requests
