"""YAML streams in and out: multi-document streams as kubectl takes them, PEM blocks kept
readable."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text and not text.startswith(" ") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def stream(docs: Iterable[tuple[str, Any]]) -> str:
    """`---`-separated documents, each after a `# Source:` comment naming where it came from."""
    return "".join(f"---\n# Source: {source}\n{dump(doc)}" for source, doc in docs)
