"""The test lanes' pins (``scripts/lanes.sh``, ``tests/constraints-py*.txt``,
``scripts/bump_constraints.sh``): each lane installs the versions the suite last passed
with, so a new patch release of jax, numpy or flax cannot turn the README's test command
red on a fresh clone; the scheduled bump moves them.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LANES = ("3.11", "3.12")
# The packages whose releases have moved the suite's results or broken it.
PINNED = ("jax", "jaxlib", "numpy", "scipy", "ml_dtypes", "flax", "equinox", "optax",
          "hypothesis", "pytest", "ruff", "mypy")


def _pins(lane: str) -> dict[str, str]:
    text = (ROOT / "tests" / f"constraints-py{lane}.txt").read_text()
    pins = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


@pytest.mark.parametrize("lane", LANES)
def test_each_lane_pins_every_package_it_installs_to_one_version(lane: str) -> None:
    text = (ROOT / "tests" / f"constraints-py{lane}.txt").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", line) for line in lines), lines
    assert "jaxpar" not in _pins(lane) and "pip" not in _pins(lane)
    for name in PINNED:
        assert re.sub(r"[-_.]+", "-", name).lower() in _pins(lane), (lane, name)
    assert text.startswith(f"# The versions the py{lane} test lane installs")


def test_the_jax_0_10_lane_pins_jax_0_10_2_and_its_cuda_plugin() -> None:
    pins = _pins("3.11")
    assert pins["jax"] == pins["jaxlib"] == "0.10.2"
    # The deviceless GPU compiles: the plugin at exactly jaxlib's version.
    assert pins["jax-cuda12-plugin"] == pins["jax-cuda12-pjrt"] == "0.10.2"
    assert "jax-cuda12-plugin" not in _pins("3.12")


@pytest.mark.parametrize("lane", LANES)
def test_the_pins_are_versions_the_projects_requirements_allow(lane: str) -> None:
    requirements = pytest.importorskip("packaging.requirements")
    pins = _pins(lane)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    ecosystem = (ROOT / "tests" / "requirements-ecosystem.txt").read_text().splitlines()
    wanted += [line for line in ecosystem if line and not line.startswith("#")]
    environment = {"python_version": lane}
    for text in wanted:
        requirement = requirements.Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        version = pins[re.sub(r"[-_.]+", "-", requirement.name).lower()]
        assert requirement.specifier.contains(version, prereleases=True), (lane, text, version)


def test_this_lane_runs_the_versions_its_constraints_name() -> None:
    # Run from a lane scripts/test.sh installed (.ci-venv/py3.11, .ci-venv/py3.12): what
    # it imports is what the constraints file says, so the file is the tested versions.
    lane = f"{sys.version_info.major}.{sys.version_info.minor}"
    if f".ci-venv{os.sep}py{lane}" not in sys.prefix or lane not in LANES:
        pytest.skip("not run from a lane of scripts/test.sh (.ci-venv/py3.11 or py3.12)")
    for name, version in _pins(lane).items():
        assert importlib.metadata.version(name) == version, name


def test_the_bump_writes_a_lanes_freeze_without_the_editable_checkout(tmp_path: Path) -> None:
    # `bump_constraints.sh --from DIR` records the lane installed in DIR/py<lane>; a fresh
    # bump does the same after installing it (that install needs the network).
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "tests").mkdir()
    for script in ("bump_constraints.sh", "lanes.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    venv = tmp_path / "venvs" / "py3.12" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "python").chmod(0o755)
    (venv / "pip").write_text(
        "#!/bin/sh\n"
        '[ "$1 $2" = "freeze --exclude-editable" ] || { echo "unexpected: $*" >&2; exit 3; }\n'
        "echo 'absl-py==2.5.1'\n"
        "echo '# Editable Git install with no remote (jaxpar==0.1.0)'\n"
        "echo 'numpy==2.5.5'\n")
    (venv / "pip").chmod(0o755)
    done = subprocess.run(["bash", str(repo / "scripts" / "bump_constraints.sh"), "--from",
                           str(tmp_path / "venvs"), "3.12"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    written = (repo / "tests" / "constraints-py3.12.txt").read_text().splitlines()
    jax_version = importlib.metadata.version("jax")
    assert written[0] == (f"# The versions the py3.12 test lane installs (pip -c; "
                          f"scripts/lanes.sh), jax {jax_version}.")
    assert written[1].startswith("# Written by scripts/bump_constraints.sh on ")
    assert written[2:] == ["absl-py==2.5.1", "numpy==2.5.5"]
    assert "2 packages" in done.stdout
    refused = subprocess.run(["bash", str(repo / "scripts" / "bump_constraints.sh"), "3.10"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown lane 3.10" in refused.stderr


def test_the_test_command_installs_under_the_constraints_and_reinstalls_when_they_change(
        tmp_path: Path) -> None:
    # scripts/test.sh's install_job with install_lane replaced by a recorder: the lane's
    # constraints file is passed to it, and a changed file changes the stamp (a reinstall).
    script = (ROOT / "scripts" / "test.sh").read_text()
    install_job = re.search(r"^install_job\(\) \{.*?^\}\n", script, re.M | re.S)
    assert install_job, "scripts/test.sh has no install_job"
    for name in ("pyproject.toml", "scripts/lanes.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "requirements-ecosystem.txt", tmp_path / "tests")
    (tmp_path / "tests" / "constraints-py3.12.txt").write_text("numpy==2.5.5\n")
    probe = ("set -euo pipefail\n"
             'install_lane() { echo "install_lane $*"; mkdir -p "$1"; }\n'
             + install_job.group(0) +
             "install_job 3.12; cat .ci-venv/install-py3.12.log\n")

    def run() -> str:
        done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = run()
    assert "install_lane .ci-venv/py3.12 3.12 tests/constraints-py3.12.txt" in first
    stamp = (tmp_path / ".ci-venv" / "py3.12" / ".jaxpar-test-stamp").read_text()
    (tmp_path / "tests" / "constraints-py3.12.txt").write_text("numpy==2.5.6\n")
    run()
    assert (tmp_path / ".ci-venv" / "py3.12" / ".jaxpar-test-stamp").read_text() != stamp


def test_lanes_installs_with_pip_c() -> None:
    # Every pip install of a lane's packages reads the constraints (the CUDA plugin's
    # --no-deps install is pinned to jaxlib's version instead).
    lanes = (ROOT / "scripts" / "lanes.sh").read_text()
    installs = [line for line in lanes.splitlines() if "pip\" install" in line
                and "--upgrade pip" not in line and "--no-deps" not in line]
    assert len(installs) == 3 and all('"${limits[@]}"' in line for line in installs), installs
    assert 'limits=(-c "$constraints")' in lanes
