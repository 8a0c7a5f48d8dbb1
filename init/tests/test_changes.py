"""From the table as it is to the plan, and back: the steps, with no iptables involved."""

from __future__ import annotations

from meshlet.init.changes import (
    AppendRule,
    CreateChain,
    DeleteChain,
    DeleteRule,
    FlushChain,
    Jump,
    NatState,
    apply_steps,
    cleanup_steps,
    nat_state,
    restore_lines,
)
from meshlet.init.plan import OUTPUT_CHAIN, REDIRECT_CHAIN, InitConfig, plan

PLAN = plan(InitConfig())
BUILTIN = frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"})


def test_fresh_table_gets_chains_rules_and_jumps() -> None:
    steps = apply_steps(PLAN, NatState(BUILTIN))
    assert steps == (
        CreateChain(REDIRECT_CHAIN),
        CreateChain(OUTPUT_CHAIN),
        *(AppendRule(rule) for rule in PLAN.rules),
        *(AppendRule(jump) for jump in PLAN.jumps),
    )


def test_applied_table_is_flushed_and_refilled_and_its_jumps_kept() -> None:
    state = NatState(
        BUILTIN | {REDIRECT_CHAIN, OUTPUT_CHAIN},
        (Jump("PREROUTING", 2, REDIRECT_CHAIN), Jump("OUTPUT", 1, OUTPUT_CHAIN)),
    )
    assert apply_steps(PLAN, state) == (
        FlushChain(REDIRECT_CHAIN),
        FlushChain(OUTPUT_CHAIN),
        *(AppendRule(rule) for rule in PLAN.rules),
    )


def test_repeated_and_stray_jumps_are_deleted_highest_number_first() -> None:
    state = NatState(
        BUILTIN | {REDIRECT_CHAIN, OUTPUT_CHAIN},
        (
            Jump("OUTPUT", 2, OUTPUT_CHAIN),
            Jump("OUTPUT", 5, OUTPUT_CHAIN),  # a second copy
            Jump("OUTPUT", 3, REDIRECT_CHAIN),  # inbound redirect on the way out: not planned
            Jump("PREROUTING", 1, REDIRECT_CHAIN),
        ),
    )
    steps = apply_steps(PLAN, state)
    assert steps[:2] == (DeleteRule("OUTPUT", 5), DeleteRule("OUTPUT", 3))
    assert not any(isinstance(s, AppendRule) and s.rule in PLAN.jumps for s in steps)


def test_a_missing_jump_is_appended() -> None:
    state = NatState(
        BUILTIN | {REDIRECT_CHAIN, OUTPUT_CHAIN}, (Jump("PREROUTING", 1, REDIRECT_CHAIN),)
    )
    assert apply_steps(PLAN, state)[-1] == AppendRule(PLAN.jumps[1])


def test_cleanup_deletes_jumps_then_chains() -> None:
    state = NatState(
        BUILTIN | {REDIRECT_CHAIN, OUTPUT_CHAIN, "SOMEONE_ELSES"},
        (
            Jump("PREROUTING", 3, REDIRECT_CHAIN),
            Jump("OUTPUT", 1, OUTPUT_CHAIN),
            Jump("OUTPUT", 4, OUTPUT_CHAIN),
        ),
    )
    assert cleanup_steps(state) == (
        DeleteRule("OUTPUT", 4),
        DeleteRule("OUTPUT", 1),
        DeleteRule("PREROUTING", 3),
        FlushChain(REDIRECT_CHAIN),
        DeleteChain(REDIRECT_CHAIN),
        FlushChain(OUTPUT_CHAIN),
        DeleteChain(OUTPUT_CHAIN),
    )


def test_cleanup_of_a_clean_table_does_nothing() -> None:
    assert cleanup_steps(NatState(BUILTIN)) == ()


def test_state_from_targets() -> None:
    state = nat_state(
        {
            "PREROUTING": ["RETURN", REDIRECT_CHAIN],
            "OUTPUT": [None, OUTPUT_CHAIN, "KEEP"],
            "KEEP": [OUTPUT_CHAIN],  # someone else's chain jumping into ours still holds it
            OUTPUT_CHAIN: [REDIRECT_CHAIN],  # inside our chains: flushed anyway
            REDIRECT_CHAIN: [],
        }
    )
    assert state.chains == {"PREROUTING", "OUTPUT", "KEEP", OUTPUT_CHAIN, REDIRECT_CHAIN}
    assert state.jumps == (
        Jump("PREROUTING", 2, REDIRECT_CHAIN),
        Jump("OUTPUT", 2, OUTPUT_CHAIN),
        Jump("KEEP", 1, OUTPUT_CHAIN),
    )


def test_restore_lines() -> None:
    steps = (CreateChain("A"), DeleteRule("OUTPUT", 2), FlushChain("A"), DeleteChain("A"))
    assert restore_lines(steps) == ["*nat", "-N A", "-D OUTPUT 2", "-F A", "-X A", "COMMIT"]
    assert restore_lines((AppendRule(PLAN.jumps[0]),))[1] == PLAN.jumps[0].render()
