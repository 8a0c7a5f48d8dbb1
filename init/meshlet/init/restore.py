"""The `iptables-nft-restore` applier (--mode nft): reads the nat table with `iptables-nft-save`,
carries out the steps as one `iptables-nft-restore --noflush` transaction."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

from meshlet.init.changes import ApplyError, NatState, Step, nat_state, restore_lines
from meshlet.init.save import parse_save, target

TIMEOUT_SECONDS = 30


class RestoreApplier:
    def __init__(self, save: str = "iptables-nft-save", restore: str = "iptables-nft-restore"):
        self.name = restore
        self._save = save
        self._restore = restore

    def saved(self) -> str:
        """The nat table as `<tool>-save -t nat` prints it."""
        return self._run([self._save, "-t", "nat"], None)

    def state(self) -> NatState:
        try:
            chains = parse_save(self.saved())
            return nat_state({chain: [target(r) for r in rules] for chain, rules in chains.items()})
        except ValueError as exc:
            raise ApplyError(f"{self._save}: {exc}") from exc

    def carry_out(self, steps: Sequence[Step]) -> None:
        self._run([self._restore, "--noflush"], "\n".join(restore_lines(steps)) + "\n")

    def _run(self, argv: list[str], stdin: str | None) -> str:
        if shutil.which(argv[0]) is None:
            raise ApplyError(f"{argv[0]} not found; install Debian's iptables package")
        try:
            result = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_SECONDS
            )
        except subprocess.TimeoutExpired as exc:
            raise ApplyError(f"{argv[0]} did not finish within {TIMEOUT_SECONDS}s") from exc
        if result.returncode != 0:
            raise ApplyError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
        return result.stdout
