"""pytest-meshlet: an application's tests run its services through a real local mesh.

Installed with meshlet (the `pytest11` entry point `meshlet`), it gives every test these
fixtures:

- `meshlet_mesh(spec, name=None, mode=None)`: builds a mesh of `spec` (a
  `meshlet.cli.mesh.spec.Spec`) for this test and returns it (`meshlet.cli.mesh.engine.Mesh`);
  every mesh it built is taken down after the test, passed or failed, and the test fails if
  anything of one is left.
- `mesh`: the mesh of the `meshlet_spec` fixture, which the test suite defines (in its
  conftest.py), for every test that asks for it.
- `meshlet_module_mesh(spec, name=None)`: the factory for a fixture of module scope, whose
  mesh every test of the module shares (a mesh's start-up once per module, not per test).

Each mesh has a place of its own (slot, addresses, network names, state folder), so pytest-xdist
workers, or two CI jobs, build theirs side by side. A mesh whose test process died before its
teardown (killed, or timed out by pytest-timeout's thread method, which ends the process) is
removed by the next mesh built on the machine. As root, pods are network namespaces with
iptables rules; without root (or with `mode="loopback"`, or `$MESHLET_MESH_MODE`), loopback
addresses whose apps use their proxy as HTTP proxy (`meshlet.cli.mesh.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the mesh's modules load when a test asks for a mesh, not with pytest
    from meshlet.cli.mesh.engine import Mesh
    from meshlet.cli.mesh.spec import Spec


def _factory() -> Iterator[Callable[..., Mesh]]:
    """Builds meshes; after the scope ends, takes every one down (failing if any left
    something)."""
    made: list[Mesh] = []

    def build(spec: Spec, name: str | None = None, mode: str | None = None) -> Mesh:
        from meshlet.cli.mesh.engine import Mesh

        mesh = Mesh(spec, name=name, mode=mode)
        made.append(mesh)
        return mesh.up()

    yield build
    problems = [problem for mesh in reversed(made) for problem in mesh.down()]
    if problems:
        pytest.fail("taking the mesh down left: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def meshlet_mesh() -> Iterator[Callable[..., Mesh]]:
    yield from _factory()


@pytest.fixture(scope="module")
def meshlet_module_mesh() -> Iterator[Callable[..., Mesh]]:
    """`meshlet_mesh` for a fixture of module scope: its meshes serve every test of the
    module and are taken down after the last (a test that drills one changes it for the
    tests after it)."""
    yield from _factory()


@pytest.fixture
def meshlet_spec() -> Spec:
    """The spec of the `mesh` fixture: define a fixture of this name in your conftest.py."""
    raise pytest.UsageError(
        "the mesh fixture builds the spec of a `meshlet_spec` fixture: define one in"
        " conftest.py returning a meshlet.cli.mesh.spec.Spec"
    )


@pytest.fixture
def mesh(meshlet_mesh: Callable[..., Mesh], meshlet_spec: Spec) -> Mesh:
    return meshlet_mesh(meshlet_spec)
