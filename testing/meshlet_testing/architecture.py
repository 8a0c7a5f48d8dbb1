"""The import rules of `architecture.toml`, checked over source trees with `ast`.

Every `import` and `from … import` statement of every module counts, wherever it is written:
at the top, inside a function, under `if TYPE_CHECKING:`, in a `try`. `from a import b` is an
import of `a.b` (a submodule or a name of `a`: a pattern for `a` covers both); relative imports
are resolved against the importing module's package. Nothing is imported to find out.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Rule:
    """Modules matching `modules` never import what matches `forbid` and not `allow`."""

    name: str
    why: str
    modules: tuple[str, ...]
    forbid: tuple[str, ...]
    allow: tuple[str, ...] = ()

    def covers(self, module: str) -> bool:
        return matches(module, self.modules)

    def forbids(self, target: str) -> bool:
        return matches(target, self.forbid) and not matches(target, self.allow)


@dataclass(frozen=True, slots=True)
class Exemption:
    """A known violation kept for now: `module` may import `imports`, for the reason given."""

    module: str
    imports: str
    why: str

    def excuses(self, violation: Violation) -> bool:
        return violation.module == self.module and matches(violation.target, (self.imports,))


@dataclass(frozen=True, slots=True)
class Rules:
    sources: tuple[str, ...]  # folders holding packages, relative to the file's folder
    rules: tuple[Rule, ...]
    exemptions: tuple[Exemption, ...] = ()


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # what it imports, dotted


@dataclass(frozen=True, slots=True)
class Violation:
    module: str
    path: Path
    line: int
    target: str
    rule: Rule

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.module} imports {self.target}, "
            f"which rule {self.rule.name!r} forbids: {' '.join(self.rule.why.split())}"
        )


@dataclass(frozen=True, slots=True)
class Report:
    violations: tuple[Violation, ...]
    stale: tuple[Exemption, ...]  # exemptions that excuse nothing any more: remove them
    modules: tuple[str, ...]  # every module scanned


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether `name` or a package above it matches one of `patterns`."""
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)


def load(path: Path) -> Rules:
    with path.open("rb") as file:
        data = tomllib.load(file)
    return Rules(
        sources=tuple(data["sources"]),
        rules=tuple(_rule(entry) for entry in data.get("rule", ())),
        exemptions=tuple(
            Exemption(entry["module"], entry["imports"], entry["why"])
            for entry in data.get("exemption", ())
        ),
    )


def _rule(entry: dict[str, Any]) -> Rule:
    return Rule(
        name=entry["name"],
        why=entry["why"],
        modules=tuple(entry["modules"]),
        forbid=tuple(entry["forbid"]),
        allow=tuple(entry.get("allow", ())),
    )


def module_name(path: Path, package_dir: Path) -> str:
    """`proxy/meshlet/proxy/http/h1.py` under `proxy/meshlet` → `meshlet.proxy.http.h1`."""
    relative = path.relative_to(package_dir.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def imports_of(path: Path, module: str) -> Iterator[Import]:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.module, node.level)
            for alias in node.names:
                target = base if alias.name == "*" else f"{base}.{alias.name}"
                yield Import(module, path, node.lineno, target)


def _resolve(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        assert name is not None
        return name
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(package):
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def scan(root: Path, sources: Sequence[str]) -> Iterator[Import | str]:
    """Every module (its name) under the source folders, each followed by its imports."""
    for source in sources:
        package_dir = root / source
        if not package_dir.is_dir():
            raise FileNotFoundError(f"architecture: source folder {package_dir} does not exist")
        for path in sorted(package_dir.rglob("*.py")):
            module = module_name(path, package_dir)
            yield module
            yield from imports_of(path, module)


def check(root: Path, rules: Rules) -> Report:
    """The violations of `rules` in the source trees under `root`, minus the exemptions."""
    violations: list[Violation] = []
    modules: list[str] = []
    used: set[Exemption] = set()
    for item in scan(root, rules.sources):
        if isinstance(item, str):
            modules.append(item)
            continue
        for rule in rules.rules:
            if not (rule.covers(item.module) and rule.forbids(item.target)):
                continue
            violation = Violation(
                item.module, item.path.relative_to(root), item.line, item.target, rule
            )
            excused = [e for e in rules.exemptions if e.excuses(violation)]
            if excused:
                used.update(excused)
            else:
                violations.append(violation)
    stale = tuple(e for e in rules.exemptions if e not in used)
    return Report(tuple(violations), stale, tuple(modules))
