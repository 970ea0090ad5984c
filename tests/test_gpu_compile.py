"""GPU programs compiled for an H100 on this machine, without a GPU (bench/compile_gpu.py --guard).

Every Pallas kernel's forward and backward (each linear mechanism and sinks + window, bf16; GDN and GLA
also in fp32, GDN at D 64) and a tiny model's final-recipe training step and floor must compile for the
card, spill no registers, fit JAX's memory pool and hold no sequence-square tensor. The compile runs in
the environment that has JAX's CUDA plugin (`.venv-gpu-aot`, made by .ci/run; or $LINJAX_GPU_AOT_PYTHON):
skipped without one on a developer's machine, failing under CI. The checks themselves are tested here
on XLA's log and HLO text, so that the guard is known to fail when a kernel spills.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, environment_with_user_xla_flags, linear_mechanisms, missing

SCRIPT = os.path.join(ROOT, "bench", "compile_gpu.py")


def _deviceless():
    spec = importlib.util.spec_from_file_location("bench_deviceless", os.path.join(ROOT, "bench", "deviceless.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def gpu_aot_python() -> str | None:
    python = os.environ.get("LINJAX_GPU_AOT_PYTHON") or os.path.join(ROOT, ".venv-gpu-aot", "bin", "python")
    return python if os.path.exists(python) else None


def test_the_guard_compiles_every_kernel_and_step_without_a_problem(tmp_path):
    python = gpu_aot_python()
    if python is None:
        missing("no environment with JAX's CUDA plugin (.venv-gpu-aot; docs/gpu.md has the install line)")
    out = tmp_path / "guard"
    done = subprocess.run([python, SCRIPT, "--guard", "--out", str(out)], capture_output=True, text=True,
                          timeout=1200, cwd=tmp_path, env=environment_with_user_xla_flags())
    rows = [json.loads(line) for line in (out / "compile.jsonl").read_text().splitlines()]
    problems = [f"{r['program']}: {r['problems']}" for r in rows if r["problems"]]
    assert done.returncode == 0 and not problems, "\n".join(problems) or done.stdout[-2000:] + done.stderr[-2000:]
    kernels = [r for r in rows if r["kind"] == "kernel"]
    assert {r["mech"] for r in kernels} == {*linear_mechanisms(), "sinks_window"}  # every mechanism of the registry
    # Each kernel program holds its Pallas kernels, with ptxas' registers read for every one of them.
    for r in kernels:
        assert r["pallas_kernels"], r["program"]
        assert all("registers" in k and "spill_bytes" in k for k in r["pallas_kernels"]), r["program"]
    steps = {r["what"]: r for r in rows if r["kind"] == "train"}
    assert set(steps) == {"recipe", "floor"} and steps["recipe"]["sequence_squares"] == []
    assert {k["name"] for k in steps["recipe"]["pallas_kernels"]} >= {"linjax_chunk_scores", "linjax_chunk_solve_wy",
                                                                       "linjax_chunk_states_bwd",
                                                                       "linjax_swa_sinks_fwd"}


PTXAS_LOG = """\
ptxas info    : Compiling entry function 'linjax_chunk_scores' for 'sm_90a'
ptxas info    : Function properties for linjax_chunk_scores
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 212 registers, used 1 barriers
ptxas info    : Compile time = 330.4 ms
ptxas info    : Compiling entry function 'linjax_chunk_wy_grads' for 'sm_90a'
    1600 bytes stack frame, 1596 bytes spill stores, 1620 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 775.6 ms
W1201 17:23:45.123456   12345 hlo_rematerialization.cc:3011] Can't reduce memory use below 90.1GiB (96743620608 bytes)
"""


def test_ptxas_registers_and_spills_are_read_from_xla_log():
    deviceless = _deviceless()
    usage = deviceless.ptxas_usage(PTXAS_LOG)
    assert usage["linjax_chunk_scores"] == {"spill_bytes": 0, "registers": 212, "ptxas_ms": 330.4}
    assert usage["linjax_chunk_wy_grads"]["spill_bytes"] == 1596
    assert deviceless.xla_warnings(PTXAS_LOG) == ["Can't reduce memory use below 90.1GiB (96743620608 bytes)"]


def test_problems_name_a_spill_a_program_over_the_pool_and_a_sequence_square():
    deviceless = _deviceless()
    card = deviceless.TARGETS["h100"].memory_bytes
    record = dict(target="h100", fits=dict(card=True, pool=True), total_bytes=card // 2, sequence_squares=[],
                  pallas_kernels=[dict(name="linjax_chunk_scores", spill_bytes=0),
                                  dict(name="linjax_chunk_wy_grads", spill_bytes=1596)])
    assert deviceless.problems(record) == ["linjax_chunk_wy_grads spills 1596 bytes of registers"]
    record.update(pallas_kernels=[], fits=dict(card=True, pool=False), total_bytes=int(0.8 * card),
                  sequence_squares=["1x9x4096x4096"])
    found = deviceless.problems(record)
    assert len(found) == 2 and "over JAX's default pool" in found[0] and "4096x4096" in found[1]
    assert deviceless.problems(dict(error="RESOURCE_EXHAUSTED: Shared memory size limit exceeded")) == [
        "does not compile: RESOURCE_EXHAUSTED: Shared memory size limit exceeded"]


def test_sequence_squares_are_told_from_other_wide_tensors():
    deviceless = _deviceless()
    text = "f32[1,9,4096,4096] bf16[4,4096,49152] f32[30,3,4,3,4095,4095] bf16[4096,576]"
    assert deviceless.sequence_squares(text, 4096) == ["1x9x4096x4096", "30x3x4x3x4095x4095"]


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_target_descriptions_are_the_cards(card):
    deviceless = _deviceless()
    text = deviceless.TARGETS[card].target_config()
    assert "core_count: 132" in text and "major: 9" in text and deviceless.TARGETS[card].name in text
