"""Route regexes (paths, header and query parameter values), compiled and budgeted as every
meshlet process does it: RE2 (linear-time matching; Rust `regex` syntax, as linkerd2-proxy's),
anchored by a full match, without captures, each pattern's memory bounded, its errors raised
rather than logged to stderr.

Linear time is not yet cheap. When a pattern's DFA would need more states than its memory
holds (`.*a.{30}`, `[ab]*a[ab]{200}`), RE2 falls back to an NFA whose cost is the number of its
program's instructions alive at each byte: measured on the reference machine, up to 12 ns per
instruction per byte, and 200-400 ns per byte for any pattern that thrashes its DFA. A proxy
matches on its event loop, so what one request may spend, and what one policy may hold, are
budgeted here, once for every component (docs/policy.md, "Regular expressions"):

- a pattern: at most `MAX_PATTERN_LENGTH` characters, and `MAX_PROGRAM_BYTES` of RE2 memory
  (its program and its DFA cache together);
- a policy (a Server's or a Service port's routes, a ServiceProfile's routes): at most
  `MAX_REGEXES` distinct patterns whose programs hold at most `MAX_PROGRAM` instructions
  together (`Budget`), so that compiling them when the policy arrives, and their memory, are
  bounded;
- a request (`Meter`): each regex it is matched against costs `(program + WEIGHT_FLOOR) x
  bytes + CALL_COST` units, at most `REQUEST_WORK` in all (about 5 ms at the NFA's worst), so
  the longer the path, the fewer regexes it may meet. A regex that cannot match (the path is
  outside the range of strings it can match, computed once) costs `CALL_COST` alone. A request
  over the budget raises `RegexBudgetExceeded`: the caller refuses it (414, or 431 for a header
  value) rather than skip the regex, so no request ever reaches a route or an authorization it
  would not have reached with every regex evaluated.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

MAX_PATTERN_LENGTH: Final = 4096  # characters: the Gateway API's longest match value
MAX_PROGRAM_BYTES: Final = 64 << 10  # RE2's memory per pattern (its default is 8 MiB)
MAX_REGEXES: Final = 128  # distinct patterns per policy or profile
MAX_PROGRAM: Final = 8192  # RE2 program instructions of a policy's patterns together
WEIGHT_FLOOR: Final = 32  # instructions' worth of per-byte cost every pattern carries
CALL_COST: Final = 128  # units of every regex a request is matched against
REQUEST_WORK: Final = 400_000  # units a request may spend matching regexes
RANGE_BYTES: Final = 64  # how much of a pattern's possible-match range is computed

# What a request's regex budget refuses, by the part of the request that was too long.
STATUS: Final = {"path": 414, "query": 414, "header": 431}


class RegexBudgetExceeded(Exception):
    """A request needs more regex matching than `REQUEST_WORK`; `subject` is what was being
    matched (path, query, header), `status` the HTTP status that refuses the request."""

    def __init__(self, subject: str) -> None:
        super().__init__(
            f"the request's {subject} is too long to match against the route's regular"
            f" expressions (at most {REQUEST_WORK} units of regex work a request;"
            " docs/policy.md)"
        )
        self.subject = subject
        self.status = STATUS[subject]


class Meter:
    """What one request may still spend matching regexes. Keeps the last text it encoded, since
    a request's path meets every path regex."""

    __slots__ = ("_data", "_text", "left")

    def __init__(self, work: int = REQUEST_WORK) -> None:
        self.left = work
        self._text: str | None = None
        self._data = b""

    def encoded(self, text: str) -> bytes:
        if text is not self._text:
            self._text, self._data = text, text.encode("utf-8", "surrogatepass")
        return self._data


@dataclass(frozen=True, slots=True)
class Regex:
    """A compiled pattern; equal to another of the same pattern."""

    pattern: str
    program: int = field(compare=False)  # RE2's program size (instructions)
    compiled: Any = field(compare=False, repr=False)
    low: bytes | None = field(default=None, compare=False, repr=False)  # every match is within
    high: bytes | None = field(default=None, compare=False, repr=False)  # [low, high]

    def fullmatch(self, text: str) -> bool:
        """Whether the whole of `text` matches, unmetered (for checks outside a request)."""
        return self.compiled.fullmatch(text.encode("utf-8", "surrogatepass")) is not None

    def matches(self, text: str, meter: Meter, subject: str = "path") -> bool:
        """Whether the whole of `text` matches, paid from `meter`; RegexBudgetExceeded when the
        request cannot afford it (`subject` names what `text` is: path, query or header)."""
        data = meter.encoded(text)
        cost = CALL_COST
        low, high = self.low, self.high
        possible = low is None or (low <= data and (high is None or data <= high))
        if possible:
            cost += (self.program + WEIGHT_FLOOR) * len(data)
        meter.left -= cost
        if meter.left < 0:
            raise RegexBudgetExceeded(subject)
        return possible and self.compiled.fullmatch(data) is not None


def compile_path_regex(regex: str) -> Regex:
    """The compiled pattern; ValueError saying why it is refused (RE2's syntax, its length or
    its memory)."""
    import re2  # lazily: ~3 MB, paid only where routes have regexes

    if len(regex) > MAX_PATTERN_LENGTH:
        raise ValueError(f"{len(regex)} characters; a pattern has at most {MAX_PATTERN_LENGTH}")
    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    options.max_mem = MAX_PROGRAM_BYTES
    try:
        compiled = re2.compile(regex, options)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        text = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)
        if "pattern too large" in text:
            text += f" (a pattern's program has at most {MAX_PROGRAM_BYTES >> 10} KiB of memory)"
        raise ValueError(text) from None
    low: bytes | None = None
    high: bytes | None = None
    with contextlib.suppress(re2.error):  # no range known: matched against every text
        low, high = compiled.possiblematchrange(RANGE_BYTES)
    return Regex(regex, compiled.programsize, compiled, low, high or None)


class PolicyTooCostly(ValueError):
    """A pattern past its policy's budget: more distinct patterns, or more instructions
    together, than a policy may hold."""


class NotCompiled(ValueError):
    """A pattern left uncompiled because its policy's regexes were refused already (the first
    refusal says why; this one need not be reported)."""


class Budget:
    """The regexes of one policy or profile, compiled once each (a pattern used twice, as a
    detect port's HTTP/1 and HTTP/2 routes use theirs, is one), refused past `MAX_REGEXES`
    distinct patterns or `MAX_PROGRAM` instructions. After a refusal nothing more is compiled
    (`NotCompiled`: the policy is refused whole), so a refused policy costs no more to read
    than an accepted one."""

    def __init__(self) -> None:
        self.regexes: dict[str, Regex] = {}
        self.program = 0
        self.refused = False

    def compile(self, pattern: str) -> Regex:
        """The pattern compiled; ValueError saying why it is refused."""
        found = self.regexes.get(pattern)
        if found is not None:
            return found
        if self.refused:
            raise NotCompiled("not compiled: the policy's regexes are refused already")
        if len(self.regexes) >= MAX_REGEXES:
            self.refused = True
            raise PolicyTooCostly(
                f"more than {MAX_REGEXES} distinct regexes (a policy holds at most"
                f" {MAX_REGEXES}, of {MAX_PROGRAM} RE2 instructions in all)"
            )
        try:
            regex = compile_path_regex(pattern)
        except ValueError:
            self.refused = True
            raise
        self.program += regex.program
        if self.program > MAX_PROGRAM:
            self.refused = True
            raise PolicyTooCostly(
                f"the regexes compile to {self.program} RE2 instructions together, this one to"
                f" {regex.program} (a policy holds at most {MAX_REGEXES} regexes, of"
                f" {MAX_PROGRAM} RE2 instructions in all)"
            )
        self.regexes[pattern] = regex
        return regex
