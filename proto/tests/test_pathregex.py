"""What a route's regex costs, as every component counts it: a request pays each regex it meets
from its meter (and is refused, never let past a regex, when it cannot pay); a policy holds a
bounded number of distinct patterns and instructions; a pattern's range of possible matches lets
a request skip it only when it cannot match."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from meshlet.api.pathregex import (
    CALL_COST,
    MAX_PATTERN_LENGTH,
    MAX_PROGRAM,
    MAX_REGEXES,
    REQUEST_WORK,
    WEIGHT_FLOOR,
    Budget,
    Meter,
    NotCompiled,
    PolicyTooCostly,
    RegexBudgetExceeded,
    compile_path_regex,
)


def test_a_request_pays_program_and_floor_per_byte_and_a_call() -> None:
    regex = compile_path_regex("/.*")
    meter = Meter(10_000)
    assert regex.matches("/abc", meter)
    assert meter.left == 10_000 - CALL_COST - (regex.program + WEIGHT_FLOOR) * 4
    assert regex.matches("/é", meter)  # paid by its UTF-8 bytes: 3
    assert meter.left == 10_000 - 2 * CALL_COST - (regex.program + WEIGHT_FLOOR) * 7


def test_a_text_outside_the_patterns_range_costs_the_call_alone() -> None:
    regex = compile_path_regex("/books/[^/]*")
    assert regex.low == b"/books/"
    meter = Meter(10_000)
    assert not regex.matches("/authors/" + "x" * 5000, meter)
    assert meter.left == 10_000 - CALL_COST


def test_a_request_that_cannot_pay_is_refused_before_the_match() -> None:
    regex = compile_path_regex("/(?:[ab]*a){400}c")  # RE2's slowest: ~12 ns an instruction-byte
    path = "/" + "a" * 8000
    meter = Meter()
    started = time.perf_counter()
    with pytest.raises(RegexBudgetExceeded) as refused:
        regex.matches(path, meter)
    assert time.perf_counter() - started < 0.01  # the match was never run
    assert (refused.value.subject, refused.value.status) == ("path", 414)
    assert "too long to match against the route's regular expressions" in str(refused.value)
    header = RegexBudgetExceeded("header")
    assert header.status == 431


def test_the_meter_is_shared_by_every_regex_of_a_request() -> None:
    regex = compile_path_regex("/.*")
    path = "/" + "x" * 999
    each = CALL_COST + (regex.program + WEIGHT_FLOOR) * len(path)
    meter = Meter()
    for _ in range(REQUEST_WORK // each):
        assert regex.matches(path, meter)
    with pytest.raises(RegexBudgetExceeded):
        regex.matches(path, meter)


# Patterns built from pieces RE2 and the range computation treat differently: literals,
# classes, repetitions, alternations, case folding, anchors, Unicode.
_PIECES = ["a", "b", "/", "é", ".", "[ab]", "[^/]", "a*", "(?:a|bc)", "b+", "x?", "[0-9]{2}",
           "(?i:ab)", "\\pL", ".*", "$", "\\b", "(?:/a|/b)"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6),
    st.lists(st.text(alphabet="ab/éABcx0123", max_size=12), min_size=1, max_size=20),
)
def test_a_text_the_pattern_matches_is_always_within_its_range(
    pieces: list[str], texts: list[str]
) -> None:
    """The range is a promise RE2 makes (`PossibleMatchRange`): were it ever wrong, a request
    would skip a regex it matches; so every match is checked against it."""
    try:
        regex = compile_path_regex("".join(pieces))
    except ValueError as exc:  # e.g. four \pL: over the program's memory, refused by design
        assert "pattern too large" in str(exc), exc
        reject()
    for text in texts:
        meter = Meter(10**9)
        if regex.fullmatch(text):
            assert regex.matches(text, meter)
            data = text.encode()
            assert regex.low is None or regex.low <= data
            assert regex.high is None or data <= regex.high


def test_a_policy_counts_each_pattern_once() -> None:
    budget = Budget()
    first = budget.compile("/v[0-9]+/.*")
    assert budget.compile("/v[0-9]+/.*") is first
    assert budget.program == first.program


def test_a_policy_holds_a_bounded_number_of_patterns() -> None:
    budget = Budget()
    for n in range(MAX_REGEXES):
        budget.compile(f"/p{n}")
    with pytest.raises(PolicyTooCostly, match=f"more than {MAX_REGEXES} distinct regexes"):
        budget.compile("/one-more")


def test_a_policy_holds_a_bounded_number_of_instructions() -> None:
    budget = Budget()
    with pytest.raises(PolicyTooCostly, match=f"at most {MAX_REGEXES} regexes, of {MAX_PROGRAM}"):
        for n in range(MAX_REGEXES):
            budget.compile(f"/[a-z]{{200}}{n}")
    assert budget.program > MAX_PROGRAM


def test_nothing_more_is_compiled_once_a_policy_is_refused() -> None:
    """So a refused policy costs no more to read than an accepted one."""
    budget = Budget()
    with pytest.raises(ValueError, match="missing \\)"):
        budget.compile("(")
    with pytest.raises(NotCompiled):
        budget.compile("/fine")
    with pytest.raises(NotCompiled):
        budget.compile("[")  # not even checked


def test_a_pattern_is_bounded_in_length_and_memory() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_PATTERN_LENGTH}"):
        compile_path_regex("a" * (MAX_PATTERN_LENGTH + 1))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"pattern too large.*KiB of memory"):
        compile_path_regex(r"\pL{1000}")
    assert time.perf_counter() - started < 0.1
