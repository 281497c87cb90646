"""Smoke test of benchmarks/run.py: every workload at its smallest size, run once.

No timing is asserted: only that plain ``jax.jit`` and both jaxpar variants compute the same
values, and that the JSON the script writes has the keys readers of it rely on.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.benchmarks import load_benchmark
from helpers.environment import needs_plugin, runs_scripts

bench = load_benchmark("run")


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "run.json"
    returned = bench.main(["--size", "smoke", "--repeats", "1", "--gpu-preview", "off",
                           "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["workloads"].keys() == returned["workloads"].keys()
    return written


def test_json_has_expected_keys(smoke_results: dict[str, Any]) -> None:
    meta = smoke_results["meta"]
    for key in ("jax", "jaxpar", "backend", "size", "repeats", "cpu_count",
                "load_1min_start", "load_1min_end", "wall_s"):
        assert key in meta, key
    assert meta["size"] == "smoke" and meta["repeats"] == 1
    assert list(smoke_results["workloads"]) == list(bench.WORKLOADS)
    for name, entry in smoke_results["workloads"].items():
        for key in ("description", "size", "variants", "max_abs_diff", "max_abs_value",
                    "plan", "gpu_preview", "load_1min"):
            assert key in entry, (name, key)
        assert set(entry["variants"]) == set(bench.VARIANTS), name
        for figures in entry["variants"].values():
            assert set(figures) >= {"median_ms", "ratio_vs_plain", "samples_ms",
                                    "first_call_s"}, name
            assert len(figures["samples_ms"]) == 1
        assert set(entry["max_abs_diff"]) == {"jaxpar_auto", "jaxpar_gpu"}, name
        assert set(entry["plan"]) == {"auto", "gpu"}, name
        for plan in entry["plan"].values():
            assert set(plan) >= {"target", "sections", "regions", "streams", "loops"}, name
        assert entry["gpu_preview"] == {"skipped": "--gpu-preview off"}


@pytest.mark.parametrize("name", list(bench.WORKLOADS))
def test_jaxpar_matches_plain(smoke_results: dict[str, Any], name: str) -> None:
    entry = smoke_results["workloads"][name]
    scale = max(1.0, entry["max_abs_value"])
    for variant, diff in entry["max_abs_diff"].items():
        assert diff <= 1e-5 * scale, (name, variant, diff)


def test_gpu_preview_keys() -> None:
    ok, message = bench.plugin_status()
    if not ok:
        pytest.skip(message)
    # Stream-annotated calls without loops inside: compiles on every jaxlib we support.
    preview = bench.preview_in_process(bench.WORKLOADS["mlp_ensemble"], "smoke",
                                       on_this_gpu=False)
    assert preview["source"] == "deviceless h200"
    for variant in ("plain", "jaxpar_gpu"):
        assert set(preview[variant]) >= {"loops", "trips", "kernels_per_trip", "entry_kernels",
                                         "async_calls_in_flight", "stream_ids", "compile_s"}
        json.dumps(preview[variant])  # JSON-serialisable


def test_overhead_reports_the_targets(tmp_path: Any) -> None:
    """benchmarks/overhead.py at a tiny size: every stage ran, and the JSON carries both
    target ratios (their values are timings, so only their presence and consistency are
    checked)."""
    overhead = load_benchmark("overhead")
    path = tmp_path / "overhead.json"
    returned = overhead.main(["--sizes", "200", "--repeats", "1", "--json", str(path)])
    written = json.loads(path.read_text())
    assert [e["total_eqns"] for e in written["sizes"]] == [
        e["total_eqns"] for e in returned["sizes"]]
    (entry,) = written["sizes"]
    assert set(entry["seconds"]) == {"lower", "make_jaxpr", "inspect", "rewrite", "lower_pb",
                                     "analysis"}
    assert all(len(s) == 1 for s in entry["samples"].values())
    targets = entry["targets"]
    assert set(targets) == {"inspect_over_lower", "lower_pb_over_lower", "met"}
    assert targets["lower_pb_over_lower"] == entry["ratio_vs_lower"]["lower_pb"]
    assert targets["met"] == (targets["inspect_over_lower"] <= overhead.INSPECT_TARGET
                              and targets["lower_pb_over_lower"] <= overhead.LOWER_PB_TARGET)


def test_overhead_floor_accounts_for_each_call(tmp_path: Any) -> None:
    """``overhead.py --floor`` at a tiny size: the parts of each call are disjoint (they
    add up to no more than the call), the floor is made of them, and jaxpar's functions
    are themselves again afterwards."""
    from jaxpar import _pipeline
    from jaxpar.passes import _walk

    overhead = load_benchmark("overhead")
    originals = (_pipeline.trace, _pipeline.run_passes, _walk._pass_step, _walk.rebuild_level)
    returned = overhead.main(["--sizes", "200", "--repeats", "1", "--floor"])
    assert (_pipeline.trace, _pipeline.run_passes, _walk._pass_step,
            _walk.rebuild_level) == originals
    (entry,) = returned["floors"]
    for stage, own in (("inspect", "report figures"), ("lower_pb", "emission and lowering")):
        row = entry[stage]
        parts = row["parts"]
        assert parts["trace"] > 0 and parts["first visits"] > 0 and parts[own] > 0
        assert all(seconds >= 0 for part, seconds in parts.items()
                   if part != "walk bookkeeping")
        assert sum(parts.values()) <= row["total"] * 1.02 + 1e-3
        assert parts["trace"] + parts["first visits"] + parts[own] <= row["floor"] <= row["total"]
        assert row["floor_over_lower"] == row["floor"] / entry["lower"]


def test_dispatch_times_every_variant_of_every_program(tmp_path: Any) -> None:
    """benchmarks/dispatch.py, a few calls: each program's variants compute the same
    numbers, and the JSON holds issue and loop times and ratios per variant."""
    dispatch = load_benchmark("dispatch")
    path = tmp_path / "dispatch.json"
    returned = dispatch.main(["--calls", "3", "--rounds", "1", "--json", str(path)])
    written = json.loads(path.read_text())
    assert list(written["programs"]) == list(returned["programs"]) == list(dispatch.PROGRAMS)
    for name, entry in written["programs"].items():
        assert "error" not in entry, (name, entry)
        assert "jaxpar" in entry["issue_us"] and entry["base"] in entry["issue_us"]
        assert set(entry["issue_us"]) == set(entry["loop_us"]) == set(entry["loop_ratio"])
        assert all(diff < 1e-5 for diff in entry["max_abs_diff"].values()), entry
        assert entry["loop_ratio"][entry["base"]] == 1.0
    assert written["geomean jaxpar"]["loop"] > 0


@runs_scripts
def test_tpu_script_dry_run(tmp_path: Any) -> None:
    """``benchmarks/tpu.sh --dry-run`` on the CPU: the calibration writes a TPU profile's
    figures, and the seed part times plain, jaxpar and the hand-written variants of the
    four two-scan programs with values compared (one timing round: the rounds only time,
    and the seed part's seven default rounds were two thirds of this test's time)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    results = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(root / "benchmarks" / "tpu.sh"), "--dry-run",
                           str(results), "calibrate,seeds", "--rounds", "1"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    calibration = json.loads((results / "calibration.json").read_text())
    assert set(calibration["profile"]) >= {"trip_s", "slice_s", "write_s", "dot_s",
                                           "block_ratios"}
    seeds = json.loads((results / "tpu-seeds.json").read_text())
    assert set(seeds) == {"seed identical bodies", "seed different bodies",
                          "crossed operand orders", "three matmuls each"}
    identical = seeds["seed identical bodies"]
    assert {"jax.jit", "jaxpar", "hand vmap (seed test3)"} <= set(identical["loop_ratio"])
    assert all(all(entry["values_match"].values()) for entry in seeds.values())


@runs_scripts
def test_tpu_script_passes_options_and_keeps_each_runs_summary(tmp_path: Any) -> None:
    """Options after the parts reach ``benchmarks/tpu.py`` (``--only`` picks programs),
    and a second run into the same folder adds its part's summary to the first's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    results = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable}
    for only in ("seed identical bodies", "crossed operand orders"):
        done = subprocess.run(["bash", str(root / "benchmarks" / "tpu.sh"), "--dry-run",
                               str(results), "seeds", "--rounds", "1", "--only", only],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert set(json.loads((results / "tpu-seeds.json").read_text())) == {only}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "tpu.py"), "--quick",
                           "--parts", "battery", "--rounds", "1", "--only", "scans_nested",
                           "--out", str(results)], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((results / "tpu-summary.json").read_text())
    assert set(summary) == {"seeds summary", "battery summary"}
    assert summary["battery summary"]["programs"] == 1
    # A part none of whose programs --only names is skipped: its files stay as they were.
    seeds_before = (results / "tpu-seeds.json").read_text()
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "tpu.py"), "--quick",
                           "--parts", "seeds,battery", "--rounds", "1", "--only",
                           "scans_nested", "--out", str(results)],
                          env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== seeds" not in done.stdout
    assert (results / "tpu-seeds.json").read_text() == seeds_before
    assert json.loads((results / "tpu-summary.json").read_text())["seeds summary"] == \
        summary["seeds summary"]
    # A name no part has, and options where the results folder belongs, are refused.
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "tpu.py"), "--quick",
                           "--parts", "battery", "--only", "scans_nestd", "--out",
                           str(results)], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "no program named scans_nestd" in done.stderr
    done = subprocess.run(["bash", str(root / "benchmarks" / "tpu.sh"), "--rounds", "9"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "come after RESULTS_DIR and PARTS" in done.stderr


@runs_scripts
def test_gpu_script_dry_run(tmp_path: Any) -> None:
    """``benchmarks/gpu.sh --dry-run`` on the CPU: calibration and one measured suite
    program at tiny sizes, the GPU-only steps skipped with a message, nothing installed
    where jaxpar looks for a GPU's profile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    results, profiles = tmp_path / "results", tmp_path / "profiles"
    env = {**os.environ, "PYTHON": sys.executable, "JAXPAR_PROFILE_DIR": str(profiles)}
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh"), "--dry-run",
                           str(results)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped (they need a GPU)" in done.stdout
    calibration = json.loads((results / "calibration.json").read_text())
    assert calibration["version"] == 2 and calibration["device_kind"] == "NVIDIA H200"
    assert calibration["measurements"]["dry_run"] is True
    assert "bandwidth" in calibration["figures"]
    (row,) = json.loads((results / "suite-lhs.json").read_text())["results"]
    measured = row["measured"]
    assert measured["command_buffers"] == "lhs" and measured["ratio"] > 0
    assert measured["estimated_ratio"] > 0
    assert "| three_towers | lhs |" in (results / "suite-lhs.txt").read_text()
    assert not profiles.exists()
    assert {"env.txt", "calibrate.txt"} <= {p.name for p in results.iterdir()}


@needs_plugin
def test_battery_runs_one_program_and_sums_up(tmp_path: Any) -> None:
    """``benchmarks/battery/run.sh`` on one program: its JSON (deviceless compiles both ways,
    values against plain jit), and ``summarize.py``'s totals; a row launching more kernels
    than plain is flagged."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable, "RESULTS": str(tmp_path)}
    done = subprocess.run(["bash", str(root / "benchmarks" / "battery" / "run.sh"), "s",
                           "typed_keys_dropout_members"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((tmp_path / "typed_keys_dropout_members@s.json").read_text())
    assert row["values_ok"] and row["jaxpar_launches"] <= row["plain_launches"]
    summarize = [sys.executable, str(root / "benchmarks" / "battery" / "summarize.py"),
                 str(tmp_path)]
    summed = subprocess.run(summarize, capture_output=True, text=True, timeout=60)
    assert summed.returncode == 0 and "1 programs, 1 compiled both ways; 0 flagged" in summed.stdout
    (tmp_path / "worse@s.json").write_text(json.dumps(
        {**row, "name": "worse", "jaxpar_launches": row["plain_launches"] + 1}))
    summed = subprocess.run(summarize, capture_output=True, text=True, timeout=60)
    assert summed.returncode == 1 and "worse: launches" in summed.stdout


def test_compile_time_quick_compares_plain_and_jaxpar(tmp_path: Any) -> None:
    """benchmarks/compile_time.py, four members, CPU: a row per consumer with both
    variants' lowering and compile seconds and their ratio (values unchecked)."""
    compile_time = load_benchmark("compile_time")
    path = tmp_path / "compile_time.json"
    returned = compile_time.main(["--quick", "--counts", "4", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["rows"] == returned["rows"]
    assert [(r["backend"], r["form"], r["members"]) for r in written["rows"]] == [
        ("cpu", form, 4) for form in compile_time.FORMS]
    for row in written["rows"]:
        assert set(row["plain"]) == set(row["jaxpar"]) == {"lower_s", "compile_s"}
        assert row["ratio"] == row["jaxpar"]["compile_s"] / row["plain"]["compile_s"]


@runs_scripts
def test_measure_script_measures_the_tpus_candidates_on_the_cpu(tmp_path: Any, monkeypatch
                                                               ) -> None:
    """``benchmarks/measure_tpu.py --cpu --target tpu``: one seed program, its first calls,
    the calls until the device decided, the steady state and the values; then the second
    process's first call reads the stored decision; the summary prints its table."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "measure_tpu.py"
    env = {**__import__("os").environ, "JAXPAR_TUNE_DIR": str(tmp_path / "decisions"),
           "JAX_PLATFORMS": "cpu"}
    common = ["--cpu", "--target", "tpu", "--parts", "seeds", "--only",
              "seed identical bodies", "--out", str(tmp_path), "--rounds", "2"]
    for extra in ([], ["--second"]):
        done = subprocess.run([sys.executable, str(script), *common, *extra], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = json.loads((tmp_path / "measure-seeds.json").read_text())["seed identical bodies"]
    assert first["max_abs_diff"] < 1e-3
    assert first["settle"]["chosen"] and first["settle"]["calls"] >= 3
    assert first["settle"]["verdict"].startswith(("measured on cpu", "nothing to measure"))
    assert first["first_call_s"]["jax.jit"] > 0 and first["first_call_s"]["jaxpar"] > 0
    # Every candidate's timed ratio, or the program it is the same as.
    candidates = first["settle"]["candidates"]
    assert candidates["jax.jit"] == 1.0 and "jaxpar, linear scans associative" in candidates
    assert all(isinstance(v, float) or v is None or v.startswith("= ")
               for v in candidates.values())
    second = json.loads((tmp_path / "measure-second.json").read_text())
    assert list(second) == ["seed identical bodies"]  # --only holds there too
    assert second["seed identical bodies"]["settle"]["source"] == "stored"
    summary = subprocess.run([sys.executable, str(script.with_name("measure_summary.py")),
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "| seed identical bodies | x" in summary.stdout
    assert "second process" in summary.stdout


@runs_scripts
def test_jit_pair_script_times_two_jit_compiles_beside_jaxpar(tmp_path: Any) -> None:
    """``benchmarks/jit_pair.py --cpu``: jaxpar settled, two jax.jit compiles, the ratios to
    the first, equal values."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "jit_pair.py"
    env = {**__import__("os").environ, "JAXPAR_TUNE_DIR": str(tmp_path / "decisions"),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script), "--cpu", "--out", str(tmp_path),
                           "--programs", "matmul_scan_w8_n5000", "--rounds", "2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "jitpair.json").read_text())["matmul_scan_w8_n5000"]
    assert set(result["loop_ratio"]) == {"jit A", "jit B", "jaxpar"}
    assert result["loop_ratio"]["jit A"] == 1.0 and result["max_abs_diff"] == 0.0
    assert result["chosen"]


@runs_scripts
def test_measure_script_reports_first_calls_where_nothing_pays(tmp_path: Any) -> None:
    """``benchmarks/measure_tpu.py --first N``: the first calls only, N of each variant, the
    median ratio, its spread and how often each variant traced the function (once)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "measure_tpu.py"
    env = {**__import__("os").environ, "JAXPAR_TUNE_DIR": str(tmp_path / "decisions"),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script), "--cpu", "--target", "tpu", "--parts",
                           "unchanged", "--only", "plain_mlp", "--first", "2", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((tmp_path / "measure-first.json").read_text())["plain_mlp"]
    assert row["traces"] == {"jax.jit": 1, "jaxpar": 1}
    assert len(row["samples"]["jax.jit"]) == len(row["samples"]["jaxpar"]) == 2
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert "plain_mlp" in done.stdout and "first call median ratios" in done.stdout
