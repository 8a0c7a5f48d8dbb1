"""`meshlet demo`: the local mesh (see command.py)."""

from meshlet.cli.demo.command import demo

__all__ = ["demo"]
