"""Power of two choices (pure: the random source is passed in)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def choose(candidates: Sequence[T], load: Callable[[T], float], rng: random.Random) -> T:
    """Of two distinct candidates drawn at random, the less loaded (the first on a tie).
    One candidate is returned as is; an empty sequence is a caller error."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(range(len(candidates)), 2)
    a, b = candidates[first], candidates[second]
    return b if load(b) < load(a) else a
