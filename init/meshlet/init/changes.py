"""From the nat table as it is to the table as planned, or back (pure): the steps of apply and
cleanup, and the one interface both appliers offer.

The live table is read into a `NatState`: which chains exist and which rules elsewhere jump into
ours. Apply flushes our chains (or creates them), refills them, and keeps exactly one jump into
each from its planned built-in chain, so running it again, with the same settings or others,
leaves one copy of the current rules. Cleanup deletes every jump into our chains, then the chains:
what meshlet-init added, nothing else. Each step knows its `iptables-restore` line, which is how
the nft applier carries it out and how both print what they did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshlet.init.plan import OUR_CHAINS, Plan, Rule


class ApplyError(RuntimeError):
    """The table could not be read or changed; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Jump:
    """A rule outside our chains whose target is one of them."""

    chain: str
    number: int  # 1-based position in `chain`, as `iptables -L --line-numbers` counts
    target: str


@dataclass(frozen=True, slots=True)
class NatState:
    chains: frozenset[str]
    jumps: tuple[Jump, ...] = ()


@dataclass(frozen=True, slots=True)
class CreateChain:
    chain: str

    @property
    def line(self) -> str:
        return f"-N {self.chain}"


@dataclass(frozen=True, slots=True)
class FlushChain:
    chain: str

    @property
    def line(self) -> str:
        return f"-F {self.chain}"


@dataclass(frozen=True, slots=True)
class DeleteChain:
    chain: str

    @property
    def line(self) -> str:
        return f"-X {self.chain}"


@dataclass(frozen=True, slots=True)
class AppendRule:
    rule: Rule

    @property
    def line(self) -> str:
        return self.rule.render()


@dataclass(frozen=True, slots=True)
class DeleteRule:
    chain: str
    number: int

    @property
    def line(self) -> str:
        return f"-D {self.chain} {self.number}"


Step = CreateChain | FlushChain | DeleteChain | AppendRule | DeleteRule


class Applier(Protocol):
    """Reads the nat table and carries out steps on it, all of them or none."""

    name: str

    def state(self) -> NatState: ...

    def carry_out(self, steps: Sequence[Step]) -> None: ...


def nat_state(targets: Mapping[str, Sequence[str | None]]) -> NatState:
    """The state of a table given as chain → the target of each of its rules, in order."""
    jumps = [
        Jump(chain, number, target)
        for chain, chain_targets in targets.items()
        if chain not in OUR_CHAINS
        for number, target in enumerate(chain_targets, start=1)
        if target in OUR_CHAINS
    ]
    return NatState(frozenset(targets), tuple(jumps))


def apply_steps(plan: Plan, state: NatState) -> tuple[Step, ...]:
    """Steps that make the table hold `plan`: stray or repeated jumps go first (the highest
    numbers first, so that the others keep theirs), then our chains are emptied and refilled, then
    any missing jump is appended."""
    wanted = {(jump.chain, jump.target) for jump in plan.jumps}
    kept: set[tuple[str, str]] = set()
    stray: list[Jump] = []
    for jump in sorted(state.jumps, key=lambda j: (j.chain, j.number)):
        key = (jump.chain, jump.target)
        if key in wanted and key not in kept:
            kept.add(key)
        else:
            stray.append(jump)
    return (
        *_deletions(stray),
        *(FlushChain(c) if c in state.chains else CreateChain(c) for c in plan.chains),
        *(AppendRule(rule) for rule in plan.rules),
        *(AppendRule(jump) for jump in plan.jumps if (jump.chain, jump.target) not in kept),
    )


def cleanup_steps(state: NatState) -> tuple[Step, ...]:
    """Steps that remove every jump into our chains, then the chains; none when nothing is
    there."""
    steps: list[Step] = list(_deletions(state.jumps))
    for chain in OUR_CHAINS:
        if chain in state.chains:
            steps += (FlushChain(chain), DeleteChain(chain))
    return tuple(steps)


def restore_lines(steps: Sequence[Step]) -> list[str]:
    """The steps as `iptables-restore --noflush` input for the nat table."""
    return ["*nat", *(step.line for step in steps), "COMMIT"]


def _deletions(jumps: Sequence[Jump]) -> list[DeleteRule]:
    ordered = sorted(jumps, key=lambda j: (j.chain, -j.number))
    return [DeleteRule(jump.chain, jump.number) for jump in ordered]


def differences(plan: Plan, saved: Mapping[str, Sequence[str]]) -> list[str]:
    """How a table read back (`iptables-save` rules by chain) differs from `plan`: [] when it
    holds the plan's chains with exactly its rules and one jump into each."""
    problems: list[str] = []
    for chain in plan.chains:
        wanted = [rule.render() for rule in plan.rules if rule.chain == chain]
        if chain not in saved:
            problems.append(f"chain {chain} is missing")
        elif list(saved[chain]) != wanted:
            problems.append(f"chain {chain} does not hold the planned rules")
    for jump in plan.jumps:
        count = list(saved.get(jump.chain, ())).count(jump.render())
        if count != 1:
            problems.append(f"{jump.chain} jumps to {jump.target} {count} times, not once")
    return problems
