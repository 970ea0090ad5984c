"""bench/kernels_gpu.py, the GPU kernel benchmark, runs end to end in its --smoke mode (tiny shapes,
Pallas interpreted on CPU), so the script a GPU session depends on is known to work before one is
at hand. No timing is checked: only that every method ran and the report was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmark_smoke_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "kernels-gpu.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernels.py"), "--gpu", "--smoke",
                    "--repeats", "1", "--out", str(out)], check=True, cwd=tmp_path, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mech"], r["method"]) for r in rows} >= {
        (m, name) for m in ("gdn", "gla") for name in ("linjax pallas", "linjax chunked", "softmax XLA")}
    assert not [r for r in rows if "error" in r], rows
    assert all(r["forward_backward_s"] > 0 for r in rows if r["method"].startswith("linjax"))
    assert (tmp_path / "kernels-gpu.md").read_text().startswith("# Kernels on")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the script would run the full benchmark")
def test_gpu_benchmark_refuses_a_machine_without_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernels_gpu.py"),
                             "--out", str(tmp_path / "k.json")], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode != 0 and "not a GPU" in result.stderr and not (tmp_path / "k.json").exists()
