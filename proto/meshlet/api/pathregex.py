"""ServiceProfile path regexes, compiled as every meshlet process compiles them: RE2 (linear-time
matching; Rust `regex` syntax, as linkerd2-proxy's), anchored by `fullmatch`, without captures,
its program bounded in memory, and its errors raised rather than logged to stderr."""

from __future__ import annotations

from typing import Any, Final

MAX_PROGRAM_BYTES: Final = 1 << 20  # RE2's compiled program per pattern (its default is 8 MiB)


def compile_path_regex(regex: str) -> Any:
    """The compiled pattern (use `.fullmatch(path)`); ValueError saying why it is refused."""
    import re2  # lazily: ~3 MB, paid only where profiles have routes

    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    options.max_mem = MAX_PROGRAM_BYTES
    try:
        return re2.compile(regex, options)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        text = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)
        raise ValueError(text) from None
