"""pytest-meshlet as an application's test suite uses it: a real pytest process, the plugin
found by its entry point, its tests passing and failing through real meshes; what a killed
run leaves removed by the next mesh."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshlet.cli.demo import network, topology
from meshlet.cli.demo.supervisor import pid_runs, state_root
from meshlet.cli.mesh import spec as mesh_spec
from meshlet.cli.mesh.engine import Mesh

# Whole meshes: make test's second lane, beside the rest (scripts/test).
pytestmark = pytest.mark.demo

CONFTEST = """
import sys

import pytest

from meshlet.cli.mesh import spec as s


@pytest.fixture
def meshlet_spec():
    files = s.service("files", [sys.executable, "-m", "http.server", "{port}"], port=8000)
    return s.Spec((files,), namespace="app")
"""

TESTS = """
import json
import sys

import pytest

from meshlet.cli.mesh import spec as s


def said(mesh):
    print("MESH", json.dumps({"name": mesh.name, "slot": mesh.layout.place.slot}), flush=True)


def test_files_answer_through_the_mesh(mesh):
    said(mesh)
    assert mesh.get("files").status == 200
    assert mesh.stat("deploy/files").mtls == 1.0


def test_that_fails(mesh):
    said(mesh)
    assert mesh.get("files").status == 500


@pytest.fixture(scope="module")
def shared(meshlet_module_mesh):
    files = s.service("files", [sys.executable, "-m", "http.server", "{port}"], port=8000)
    return meshlet_module_mesh(s.Spec((files,), namespace="app"))


def test_a_module_mesh(shared):
    said(shared)
    assert shared.get("files").status == 200


def test_the_same_module_mesh(shared):
    said(shared)
    assert shared.stat("deploy/files").requests >= 1  # the request of the test before


def test_two_meshes_at_once(meshlet_mesh, meshlet_spec):
    first, second = meshlet_mesh(meshlet_spec), meshlet_mesh(meshlet_spec)
    said(first)
    said(second)
    assert first.layout.place.slot != second.layout.place.slot
    assert first.get("files").status == second.get("files").status == 200
"""


def suite(folder: Path, tests: str) -> Path:
    """An application's test folder of its own (its own pytest.ini: not this repository's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_app.py").write_text(textwrap.dedent(tests))
    return folder


def pytest_argv(folder: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--rootdir", str(folder), str(folder), *more]  # fmt: skip


def places_made(out: str) -> list[topology.Place]:
    """The meshes a run's tests said they had (`MESH {"name": …, "slot": …}` lines)."""
    return [topology.Place(m["name"], m["slot"])
            for m in map(json.loads, re.findall(r"MESH (\{.*?\})", out))]  # fmt: skip


def mesh_said(proc: subprocess.Popen[str]) -> topology.Place:
    """The mesh a running test says it holds (its first `MESH …` line)."""
    assert proc.stdout is not None
    line = ""
    while "MESH " not in line:
        line = proc.stdout.readline()
        assert line, "the test run ended before its mesh was up"
    (place,) = places_made(line)
    return place


def left_of(place: topology.Place) -> list[str]:
    found = network.existing_netns(place.netns_prefix)
    found += [place.bridge] if network.link_exists(place.bridge) else []
    found += [str(state_root(place.name))] if state_root(place.name).exists() else []
    return found


@pytest.mark.netns
def test_an_applications_suite_passes_and_fails_through_meshes_and_leaves_nothing(
    netns_available: None, tmp_path: Path
) -> None:
    folder = suite(tmp_path / "app", TESTS)
    run = subprocess.run(pytest_argv(folder, "-s", "-q"), capture_output=True, text=True,
                         timeout=240, check=False, cwd=folder)  # fmt: skip
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 failed, 4 passed" in run.stdout, run.stdout[-4000:]
    assert "assert 200 == 500" in run.stdout
    made = places_made(run.stdout)
    assert len(made) == 6 and len({place.name for place in made}) == 5, made  # one shared
    assert [left_of(place) for place in made] == [[]] * 6


@pytest.mark.netns
def test_a_killed_runs_mesh_is_removed_by_the_next_mesh(
    netns_available: None, tmp_path: Path
) -> None:
    folder = suite(tmp_path / "app", """
        import json, time


        def test_killed_while_it_runs(mesh):
            print("MESH", json.dumps({"name": mesh.name, "slot": mesh.layout.place.slot}),
                  flush=True)
            time.sleep(120)
    """)  # fmt: skip
    proc = subprocess.Popen(pytest_argv(folder, "-s", "-q"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=folder)  # fmt: skip
    try:
        dead = mesh_said(proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert left_of(dead)  # a killed run's teardown never ran
    record = json.loads((state_root(dead.name) / "state.json").read_text())
    assert any(pid_runs(pid) for pid in record["processes"].values())
    files = mesh_spec.service("files", [sys.executable, "-m", "http.server", "{port}"], port=8000)
    with Mesh(mesh_spec.Spec((files,))) as mesh:
        # its processes, folders and network are gone: its slot is the new mesh's to build in
        assert not any(pid_runs(pid) for pid in record["processes"].values())
        assert not state_root(dead.name).exists() and not Path(record["shm"]).exists()
        assert mesh.layout is not None and mesh.layout.place.slot == dead.slot
        assert mesh.get("files").status == 200
    assert left_of(dead) == []


SLEEPER = """
    import json, time


    def test_interrupted_while_it_runs(mesh):
        print("MESH", json.dumps({"name": mesh.name, "slot": mesh.layout.place.slot}),
              flush=True)
        time.sleep(60)
"""


@pytest.mark.netns
@pytest.mark.parametrize("how", ["ctrl-c", "timeout"])
def test_an_interrupted_or_timed_out_tests_mesh_is_taken_down(
    netns_available: None, tmp_path: Path, how: str
) -> None:
    """Ctrl-C (SIGINT to pytest) or pytest-timeout (its signal method) while a test holds
    a mesh: the fixture's teardown runs and nothing of the mesh is left."""
    folder = suite(tmp_path / "app", SLEEPER)
    # pytest-timeout counts the fixture's set-up: time for a mesh up on a busy machine
    more = ["--timeout", "8", "--timeout-method", "signal"] if how == "timeout" else []

    def as_from_a_terminal() -> None:  # a run started in the background ignores SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(pytest_argv(folder, "-s", "-q", *more), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=folder,
                            preexec_fn=as_from_a_terminal)  # fmt: skip
    try:
        mesh = mesh_said(proc)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    want = "KeyboardInterrupt" if how == "ctrl-c" else "Timeout"
    assert want in out, out[-3000:]
    assert left_of(mesh) == []
