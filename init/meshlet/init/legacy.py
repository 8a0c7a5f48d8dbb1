"""The python-iptables applier (--mode legacy, the default): reads and changes the legacy nat table
through libiptc, every step in one commit.

What python-iptables needs at run time on Debian: `libxtables.so.12` and `libip4tc.so.2`
(packages libxtables12 and libip4tc2, both pulled in by `iptables`), found with ctypes through
`ldconfig -p`; the folder of xtables extensions (`/usr/lib/<arch>/xtables`, from `iptables`),
found by scanning `ldconfig -N -v` unless `XTABLES_LIBDIR` names it; and, on kernels with
loadable modules, `modprobe` (package kmod) to load ip_tables, which it runs when imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshlet.init.changes import (
    AppendRule,
    ApplyError,
    CreateChain,
    DeleteChain,
    DeleteRule,
    FlushChain,
    NatState,
    Step,
    nat_state,
)
from meshlet.init.plan import Rule


def _load() -> Any:
    try:
        import iptc
    except Exception as exc:  # python-iptables raises whatever ctypes or its loader meets
        raise ApplyError(
            f"python-iptables cannot load libxtables and libip4tc ({exc!r}); install Debian's"
            " iptables package (and kmod where the kernel has modules), set XTABLES_LIBDIR to the"
            " xtables extensions folder, or use --mode nft"
        ) from exc
    return iptc


class IptcApplier:
    name = "python-iptables"

    def __init__(self) -> None:
        self._iptc = _load()
        self._errors = (self._iptc.IPTCError, self._iptc.XTablesError, ValueError, IndexError)
        try:
            self._table = self._iptc.Table(self._iptc.Table.NAT, autocommit=False)
            self._table.refresh()
        except self._errors as exc:
            raise ApplyError(f"python-iptables cannot open the legacy nat table: {exc}") from exc

    def state(self) -> NatState:
        try:
            return nat_state(
                {chain.name: [r.target.name for r in chain.rules] for chain in self._table.chains}
            )
        except self._errors as exc:
            raise ApplyError(f"python-iptables cannot read the legacy nat table: {exc}") from exc

    def carry_out(self, steps: Sequence[Step]) -> None:
        for step in steps:
            try:
                self._do(step)
            except self._errors as exc:
                self._table.refresh()  # drops the uncommitted steps: all or nothing
                raise ApplyError(f"python-iptables: {step.line}: {exc}") from exc
        try:
            self._table.commit()
        except self._errors as exc:
            raise ApplyError(f"python-iptables: commit of the nat table failed: {exc}") from exc

    def _do(self, step: Step) -> None:
        match step:
            case CreateChain(chain):
                self._table.create_chain(chain)
            case FlushChain(chain):
                self._table.flush_entries(chain)
            case DeleteChain(chain):
                self._table.delete_chain(chain)
            case AppendRule(rule):
                self._iptc.Chain(self._table, rule.chain).append_rule(self._rule(rule))
            case DeleteRule(chain, number):
                live = self._iptc.Chain(self._table, chain)
                live.delete_rule(live.rules[number - 1])

    def _rule(self, rule: Rule) -> Any:
        """The same rule as python-iptables builds it; the order of its parts is the order
        iptables-save prints them in, so a read-back matches `rule.render()`."""
        built = self._iptc.Rule()
        if rule.destination is not None:
            built.dst = str(rule.destination)
        if rule.out_interface is not None:
            built.out_interface = rule.out_interface
        if rule.protocol is not None:
            built.protocol = rule.protocol
        for match in rule.matches:
            _set(built.create_match(match.name), match.options)
        built.create_match("comment").comment = rule.comment
        _set(built.create_target(rule.target), rule.target_options)
        return built


def _set(extension: Any, options: tuple[tuple[str, str], ...]) -> None:
    for name, value in options:
        setattr(extension, name.replace("-", "_"), value)
