"""Which kinds the validating webhook judges, and the function that judges each.

A validator takes the object under review (`request.object`) and returns every problem as
`path: what is wrong` strings, [] when the object is valid; it never raises. Each is the one
definition of a valid object that its reader (destination, policy controller) also uses, so the
API server refuses what the mesh would otherwise ignore with a log line nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from meshlet.controlplane.destination import profiles
from meshlet.controlplane.policy import resources

Validator = Callable[[Mapping[str, Any]], list[str]]

# (API group, kind) → validator. Kinds not listed are allowed unjudged.
VALIDATORS: Final[Mapping[tuple[str, str], Validator]] = {
    ("meshlet.io", "ServiceProfile"): profiles.problems,
    **{(api_version.rpartition("/")[0], kind): resources.problems
       for api_version, kind in resources.KINDS},
}  # fmt: skip
