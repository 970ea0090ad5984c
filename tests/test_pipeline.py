"""`linjax run`: every stage once, a report, and a restart that skips what is finished."""

import json
import os
import subprocess
import sys
import time

import pytest

TEXT = ("Linear attention keeps a state of fixed size. Softmax attention keeps every key. "
        "The window holds the recent tokens exactly, and the sinks hold the first ones. ") * 30


def _experiment(tmp_path, source, evaluations=("perplexity", "approx"), extra=""):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n'
                      f'[model]\nsource = "{source}"\n'
                      '[linearize]\nmechanism = "gdn"\nwindow = 8\nsinks = 2\nadapter = "shortconv"\n'
                      f'[data]\npaths = ["{data}"]\n'
                      '[train]\nsteps = 4\nseq_len = 32\nbatch_size = 1\nwarmup_steps = 1\ncheckpoint_every = 2\n'
                      f'[eval]\nrun = {json.dumps(list(evaluations))}\nperplexity_data = "{data}"\n'
                      'perplexity_seq_len = 32\nperplexity_windows = 2\n'
                      f'approx_data = "{data}"\napprox_num_seqs = 2\napprox_seq_len = 32\n' + extra)
    return config


def _command(config):
    return [sys.executable, "-m", "linjax.app.cli", "run", str(config)]


@pytest.mark.slow  # whole `linjax run` pipelines in subprocesses
def test_run_writes_a_report_and_a_restart_skips_finished_stages(tiny_source, tmp_path):
    config = _experiment(tmp_path, tiny_source)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(_command(config), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    trained = run_dir / "stages" / "train.json"
    for _ in range(6000):  # poll for up to ~5 minutes
        if trained.exists() or process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    output = process.communicate()[0]
    assert trained.exists(), output[-3000:]
    assert not (run_dir / "stages" / "perplexity.json").exists(), "the run finished before it could be killed"
    metrics_before = (run_dir / "metrics.jsonl").read_text()

    result = subprocess.run(_command(config), cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "convert: already done, skipped" in result.stdout
    assert "train: already done, skipped" in result.stdout
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before  # training was not redone
    assert sorted(os.listdir(run_dir / "stages")) == ["approx.json", "convert.json", "perplexity.json",
                                                      "report.json", "train.json"]
    perplexity = json.loads((run_dir / "stages" / "perplexity.json").read_text())
    assert set(perplexity["rows"]) == {"original", "linearized, before training", "linearized, trained"}
    report = (run_dir / "report.md").read_text()
    assert "## Training" in report and "## Perplexity" in report and "linearized, trained" in report
    assert "## Approximation error" in report and "approx/approx_per_layer.png" in report
    assert (run_dir / "training_loss.png").stat().st_size > 1000

    again = subprocess.run(_command(config), cwd=tmp_path, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and again.stdout.count("already done, skipped") == 5


PIQA = [{"goal": "To dry wet shoes,", "sol1": "stuff them with newspaper.", "sol2": "fill them with water."},
        {"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "paint the lid."}]


@pytest.mark.slow  # a whole `linjax run` pipeline in a subprocess
def test_lm_eval_and_ruler_stages_compare_with_the_original_and_the_window_baseline(tiny_source, tmp_path):
    benchmarks = tmp_path / "benchmarks"
    (benchmarks / "piqa").mkdir(parents=True)
    (benchmarks / "piqa" / "valid.jsonl").write_text("".join(json.dumps(d) + "\n" for d in PIQA))
    (benchmarks / "piqa" / "valid-labels.lst").write_text("0\n0\n")
    extra = (f'lm_eval_data_dir = "{benchmarks}"\nlm_eval_tasks = ["piqa"]\nlm_eval_limit = 2\n'
             'ruler_tasks = ["niah_single_1"]\nruler_lengths = [120]\nruler_samples = 1\n')
    config = _experiment(tmp_path, tiny_source, ("lm_eval", "ruler"), extra)
    result = subprocess.run(_command(config), cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run_dir = tmp_path / "run"
    lm_eval = json.loads((run_dir / "stages" / "lm_eval.json").read_text())
    assert set(lm_eval["models"]) == {"original", "linearized, trained"}
    for summary in lm_eval["models"].values():
        assert 0 <= summary["results"]["piqa"]["acc,none"] <= 1 and summary["n-samples"]["piqa"]["effective"] == 2
    ruler = json.loads((run_dir / "stages" / "ruler.json").read_text())
    assert set(ruler["models"]) == {"linearized, trained", "original", "window only"}
    assert [r["variant"] for r in ruler["models"]["window only"]["results"]] == [
        "window only, budget 10 (sinks 2, window 8)"]
    report = (run_dir / "report.md").read_text()
    assert "| task | metric | original | linearized, trained |" in report and "| piqa | acc |" in report
    assert "| niah_single_1 | 120 | window only | window only, budget 10 (sinks 2, window 8) |" in report


TORCH_LOGITS = r"""
import json, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
tokens = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    print(json.dumps({"class": type(model).__name__, "logits": model(tokens).logits.numpy().tolist()}))
assert "jax" not in sys.modules
"""


@pytest.mark.slow  # `linjax train` and `linjax export` in subprocesses
def test_export_cli_writes_a_run_directory_that_torch_loads_without_jax(tiny_source, tmp_path):
    """`linjax export RUN --out DIR` on a finished training run: the PyTorch model gives linjax's logits."""
    import numpy as np

    import linjax

    config = _experiment(tmp_path, tiny_source, evaluations=())
    result = subprocess.run([sys.executable, "-m", "linjax.app.cli", "train", str(config)], cwd=tmp_path,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "linjax.app.cli", "export", str(tmp_path / "run"),
                             "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "trust_remote_code=True" in result.stdout, result.stderr[-3000:]
    assert {"config.json", "model.safetensors", "modeling_linjax.py", "tokenizer.json"} <= set(os.listdir(out))
    tokens = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 300, 2]]
    check = subprocess.run([sys.executable, "-c", TORCH_LOGITS, str(out), json.dumps(tokens)], cwd=tmp_path,
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr[-3000:]
    torch_side = json.loads(check.stdout.strip().splitlines()[-1])
    model, _ = linjax.load(str(tmp_path / "run"))
    expected = np.asarray(model(np.asarray(tokens, np.int32)))
    assert torch_side["class"] == "LinjaxForCausalLM"
    assert np.abs(np.asarray(torch_side["logits"]) - expected).max() <= 1e-4
