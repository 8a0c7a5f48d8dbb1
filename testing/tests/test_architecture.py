"""The repository keeps the layers and boundaries of architecture.toml (docs/architecture.md);
and the checker finds what breaks them, on small trees written for the purpose."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from meshlet_testing.architecture import Exemption, Rule, Rules, check, load

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_imports_nothing_its_rules_forbid() -> None:
    report = check(ROOT, load(ROOT / "architecture.toml"))
    assert not report.violations, "\n" + "\n".join(str(v) for v in report.violations)
    assert not report.stale, f"exemptions that excuse nothing any more: {report.stale}"


def test_every_rule_covers_modules_that_exist() -> None:
    rules = load(ROOT / "architecture.toml")
    report = check(ROOT, rules)
    assert "meshlet.proxy.http.h1" in report.modules  # the scan reaches the proxy's engines
    for rule in rules.rules:
        for pattern in rule.modules:
            assert any(Rule("", "", (pattern,), ()).covers(m) for m in report.modules), (
                f"rule {rule.name!r}: {pattern} names no module"
            )
    for exemption in rules.exemptions:
        assert exemption.module in report.modules, exemption


# The checker itself, on a tree of two packages: `meshlet.low` must not import `meshlet.high`.

LOW_BELOW_HIGH = Rule(
    name="low-below-high",
    why="low is below high",
    modules=("meshlet.low",),
    forbid=("meshlet.high", "socket"),
    allow=("meshlet.high.values",),
)


PACKAGES = {"meshlet/high/__init__.py": "", "meshlet/low/__init__.py": ""}


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {**PACKAGES, **files}.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def violations(root: Path, *exemptions: Exemption) -> list[str]:
    report = check(root, Rules(("src/meshlet",), (LOW_BELOW_HIGH,), exemptions))
    return [f"{v.path}:{v.line} {v.module} -> {v.target}" for v in report.violations]


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "meshlet/low/engine.py": "import asyncio\nfrom meshlet.low import other\n",
        "meshlet/low/other.py": "from . import engine\nfrom .engine import run\n",
        "meshlet/high/app.py": "from meshlet.low.engine import run\nimport socket\n",
    })  # fmt: skip
    assert violations(root) == []


@pytest.mark.parametrize(
    ("source", "line", "target"),
    [
        ("import meshlet.high.app\n", 1, "meshlet.high.app"),
        ("\nfrom meshlet.high.app import Server\n", 2, "meshlet.high.app.Server"),
        ("from meshlet.high import app\n", 1, "meshlet.high.app"),
        ("import socket as s\n", 1, "socket"),
        ("from ..high import app\n", 1, "meshlet.high.app"),
        ("from ..high.app import Server\n", 1, "meshlet.high.app.Server"),
        (
            """\
            def later():
                from meshlet.high.app import Server
                return Server
            """,
            2,
            "meshlet.high.app.Server",
        ),
        (
            """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from meshlet.high.app import Server
            """,
            4,
            "meshlet.high.app.Server",
        ),
        ("try:\n    import meshlet.high\nexcept ImportError:\n    pass\n", 2, "meshlet.high"),
    ],
    ids=[
        "import",
        "from",
        "from-package",
        "stdlib",
        "relative",
        "relative-from",
        "in-function",
        "type-checking",
        "in-try",
    ],
)
def test_a_forbidden_import_is_reported_with_its_file_and_line(
    tmp_path: Path, source: str, line: int, target: str
) -> None:
    root = tree(tmp_path, {"meshlet/low/engine.py": source})
    assert violations(root) == [f"src/meshlet/low/engine.py:{line} meshlet.low.engine -> {target}"]


def test_a_package_init_resolves_relative_imports_from_itself(tmp_path: Path) -> None:
    root = tree(tmp_path, {"meshlet/low/__init__.py": "from ..high import app\n"})
    assert violations(root) == ["src/meshlet/low/__init__.py:1 meshlet.low -> meshlet.high.app"]


def test_what_is_allowed_is_not_forbidden(tmp_path: Path) -> None:
    root = tree(tmp_path, {"meshlet/low/engine.py": "from meshlet.high.values import Labels\n"})
    assert violations(root) == []


def test_a_violation_names_the_rule_and_why(tmp_path: Path) -> None:
    root = tree(tmp_path, {"meshlet/low/engine.py": "import meshlet.high\n"})
    report = check(root, Rules(("src/meshlet",), (LOW_BELOW_HIGH,)))
    assert [str(v) for v in report.violations] == [
        "src/meshlet/low/engine.py:1: meshlet.low.engine imports meshlet.high, which rule "
        "'low-below-high' forbids: low is below high"
    ]


def test_an_exemption_excuses_its_import_and_turns_stale_once_it_is_gone(tmp_path: Path) -> None:
    root = tree(tmp_path, {"meshlet/low/engine.py": "from meshlet.high.app import Server\n"})
    known = Exemption("meshlet.low.engine", "meshlet.high.app", "not yet moved")
    assert violations(root, known) == []
    (root / "src/meshlet/low/engine.py").write_text("")
    report = check(root, Rules(("src/meshlet",), (LOW_BELOW_HIGH,), (known,)))
    assert report.stale == (known,)


def test_the_rules_file_reads_as_the_checker_applies_it(tmp_path: Path) -> None:
    (tmp_path / "architecture.toml").write_text(textwrap.dedent("""\
        sources = ["src/meshlet"]

        [[rule]]
        name = "low-below-high"
        why = "low is below high"
        modules = ["meshlet.low"]
        forbid = ["meshlet.high", "socket"]
        allow = ["meshlet.high.values"]

        [[exemption]]
        module = "meshlet.low.engine"
        imports = "meshlet.high.app"
        why = "not yet moved"
    """))  # fmt: skip
    rules = load(tmp_path / "architecture.toml")
    assert rules == Rules(
        ("src/meshlet",),
        (LOW_BELOW_HIGH,),
        (Exemption("meshlet.low.engine", "meshlet.high.app", "not yet moved"),),
    )
