"""The proxy's log lines: a client-chosen value can never start a line of its own (control
characters escaped, plain and JSON alike), and the level changes at run time by name only."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest

from meshlet.proxy import logs


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored after the test (`setup` replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord(
        "meshlet.proxy.test", logging.WARNING, __file__, 1, message, args, exc_info
    )


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("plain text", "plain text"),
        ("line\nforged", "line\\x0aforged"),
        ("carriage\rreturn", "carriage\\x0dreturn"),
        ("nul\x00byte", "nul\\x00byte"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),  # terminal escapes
        ("del\x7f", "del\\x7f"),
        ("c1\x85next\x9bline", "c1\\x85next\\x9bline"),  # NEL and CSI (C1 controls)
        ("tab\tstays", "tab\tstays"),
        ("café ☕ \xa0", "café ☕ \xa0"),  # printable non-ASCII is left alone
    ],
)
def test_escape(text: str, escaped: str) -> None:
    assert logs.escape(text) == escaped


def test_a_plain_line_stays_one_line_whatever_the_client_sent() -> None:
    host = "evil\r\n2024-01-01 00:00:00,000 ERROR meshlet.proxy: forged"
    line = logs.PlainFormatter().format(record("connection from %s refused", host))
    assert "\n" not in line and "\r" not in line
    assert line.endswith(
        "WARNING meshlet.proxy.test: connection from evil\\x0d\\x0a2024-01-01 00:00:00,000 "
        "ERROR meshlet.proxy: forged refused"
    )


def test_a_plain_traceback_is_escaped_into_the_same_line() -> None:
    line = logs.PlainFormatter().format(record("failed", exc=True))
    assert "\n" not in line
    assert "failed\\x0aTraceback (most recent call last):" in line
    assert "ValueError: bad\\x0avalue" in line


def test_a_json_line_is_one_object_with_the_message_escaped() -> None:
    line = logs.JsonFormatter().format(record("from %s: %s", "a\nb", "naïve\x1b"))
    assert "\n" not in line and line.isascii()
    parsed = json.loads(line)
    assert parsed["message"] == "from a\nb: naïve\x1b"  # intact once parsed
    assert parsed["level"] == "WARNING"
    assert parsed["logger"] == "meshlet.proxy.test"
    assert len(parsed["time"]) == len("2024-01-01T00:00:00.000")
    assert parsed["time"][10] == "T" and parsed["time"][19] == "."
    assert "error" not in parsed


def test_a_json_line_carries_the_traceback_as_error() -> None:
    parsed = json.loads(logs.JsonFormatter().format(record("failed", exc=True)))
    assert parsed["message"] == "failed"
    assert parsed["error"].startswith("Traceback (most recent call last):")
    assert parsed["error"].endswith("ValueError: bad\nvalue")


@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_setup_logs_to_stderr_in_the_format_and_at_the_level(
    fmt: str, root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.setup("warn", fmt)
    assert root_logger.level == logging.WARNING
    assert len(root_logger.handlers) == 1
    log = logging.getLogger("meshlet.proxy.test")
    log.info("not shown")
    log.warning("shown\nonce")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    if fmt == "json":
        assert json.loads(lines[0])["message"] == "shown\nonce"
    else:
        assert lines[0].endswith("WARNING meshlet.proxy.test: shown\\x0aonce")


@pytest.mark.parametrize(
    ("text", "name", "level"),
    [
        ("trace", "trace", logging.DEBUG),
        ("debug", "debug", logging.DEBUG),
        ("info", "info", logging.INFO),
        ("warn", "warn", logging.WARNING),
        ("warning", "warning", logging.WARNING),
        ("error", "error", logging.ERROR),
        (" WARN\n", "warn", logging.WARNING),  # an admin request body, as curl sends it
    ],
)
def test_set_level_accepts_the_level_names(
    text: str, name: str, level: int, root_logger: logging.Logger
) -> None:
    root_logger.setLevel(logging.CRITICAL)
    assert logs.set_level(text) == name
    assert root_logger.level == level


@pytest.mark.parametrize("text", ["", "verbose", "DEBUG2", "critical", "10", "in fo", "x" * 100])
def test_set_level_refuses_other_names_and_keeps_the_level(
    text: str, root_logger: logging.Logger
) -> None:
    root_logger.setLevel(logging.ERROR)
    with pytest.raises(ValueError, match="expected one of trace, debug, info, warn, error") as e:
        logs.set_level(text)
    assert root_logger.level == logging.ERROR
    assert len(str(e.value)) < 120  # the name is quoted cut short, whatever its length
