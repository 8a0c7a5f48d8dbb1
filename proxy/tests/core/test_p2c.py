"""Power of two choices over loads."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.p2c import choose


def test_one_candidate() -> None:
    assert choose(["a"], lambda _: 1.0, random.Random(1)) == "a"


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        choose([], lambda _: 1.0, random.Random(1))


def test_the_most_loaded_is_never_chosen() -> None:
    loads = {"a": 1.0, "b": 2.0, "c": 3.0}
    rng = random.Random(7)
    picks = Counter(choose(list(loads), loads.__getitem__, rng) for _ in range(3000))
    assert picks["c"] == 0
    assert picks["a"] > picks["b"] > 0  # a wins both pairs it is in, b only against c


@given(st.lists(st.floats(0, 1e6), min_size=2, max_size=20), st.integers(0, 2**32))
def test_the_pick_is_never_worse_than_the_other_drawn(loads: list[float], seed: int) -> None:
    indices = list(range(len(loads)))
    rng = random.Random(seed)
    first, second = random.Random(seed).sample(indices, 2)
    picked = choose(indices, loads.__getitem__, rng)
    assert picked in (first, second)
    assert loads[picked] <= max(loads[first], loads[second])
    assert loads[picked] == min(loads[first], loads[second])
