"""bench/gpu_check.py, the one-command GPU check, runs every part end to end in its --smoke mode
(tiny shapes, Pallas interpreted on a CPU), so the script a GPU session depends on is known to work
before one is at hand. No timing is checked: only that each part ran and the report was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import linear_mechanisms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")


@pytest.mark.slow  # every part in its own process: about a minute; CI runs it with the other slow tests
def test_smoke_run_writes_every_part(tmp_path):
    out = tmp_path / "check"
    subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], check=True, cwd=tmp_path, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["exit 0"] * len(report["parts"]), report["parts"]
    assert [p["part"].split()[0] for p in report["parts"]] == ["train", "torch", "train", "kernels", "tests",
                                                                "kernels", "fla"]
    rows = report["rows"]
    by_part = {part: [r for r in rows if r["part"] == part] for part in ("tests", "train", "torch", "kernels", "fla")}
    assert all(by_part.values()), {k: len(v) for k, v in by_part.items()}
    assert [r["outcome"] for r in by_part["tests"] if r["test"] == "(all)"] == ["passed"]
    for part in ("train", "torch", "kernels"):
        assert not [r for r in by_part[part] if "error" in r], by_part[part]
    # The final recipe's steps record every step's loss and gradient norm, finite.
    assert [(r["batch"], r["T"]) for r in by_part["train"]] == [(1, 128), (2, 128)]  # beyond the 64-token cache
    for r in by_part["train"]:
        assert len(r["losses"]) == len(r["grad_norms"]) == 3 and all(0 < x < 100 for x in r["losses"] + r["grad_norms"])
        assert r["median_step_s"] > 0 and r["first_step_s"] >= r["compile_s"] > 0
    mechanisms = {*linear_mechanisms(), "sinks_window"}
    short = [r for r in by_part["kernels"] if r["T"] == 40]
    assert {(r["mech"], r["kernel"]) for r in short} >= {(m, f) for m in mechanisms for f in ("pallas", "chunked")}
    assert {r["mech"] for r in short} >= {"softmax, full causal", "softmax, local window 64"}
    # The Pallas form agrees with chunked (interpreted here, fp32).
    assert all(r["relative_rms_vs_chunked"] < 1e-5 for r in short if r["kernel"] == "pallas"), short
    assert all(r["forward_backward_s"] > 0 for r in by_part["kernels"])
    assert (out / "gpu_check.md").read_text().startswith("# linjax GPU check on")
    assert "== train tiny 1x128" in (out / "gpu_check.log").read_text()
    # A second run never overwrites the first one's rows.
    again = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_bad_parts_are_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--smoke", "--parts", "tests,speed", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--parts" in result.stderr
