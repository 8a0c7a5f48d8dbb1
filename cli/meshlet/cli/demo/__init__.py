"""`meshlet demo`: the local mesh (see command.py). Nothing is imported here: the demo image
runs `python -m meshlet.cli.demo.apps` without the CLI's extra (rich)."""
