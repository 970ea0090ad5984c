"""Trust (issue 39, item 6): a model directory's own Python runs only when it is linjax's export code or the
user says so; lm-eval's scores are keyed on the weights and the tokenizer; results are never overwritten
without --overwrite."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from linjax.convert.export import MODELING_FILES
from linjax.eval import lm_eval_bridge
from tests.helpers import require_module
from tests.test_reliability import one_line_error, run_cli

LINJAX_AUTO_MAP = {"AutoConfig": "modeling_linjax.LinjaxConfig",
                   "AutoModelForCausalLM": "modeling_linjax.LinjaxForCausalLM"}


def export_like(directory, auto_map=LINJAX_AUTO_MAP):
    """What a linjax export of a linearized model holds besides its weights: config.json with auto_map and
    linjax's modeling files."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "linjax", "auto_map": auto_map}, f)
    for path in MODELING_FILES:
        shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
    return str(directory)


def test_linjax_export_code_is_trusted_and_nothing_else(tmp_path):
    ours = export_like(tmp_path / "ours")
    assert lm_eval_bridge.remote_code_trusted(ours) is True
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert lm_eval_bridge.remote_code_trusted(str(plain)) is False  # nothing asks to run

    edited = export_like(tmp_path / "edited")
    with open(os.path.join(edited, "modeling_linjax_kernels.py"), "a") as f:
        f.write("\nimport os  # one line more\n")
    with pytest.raises(ValueError, match=r"modeling_linjax_kernels\.py.*--trust-remote-code.*export the model"):
        lm_eval_bridge.remote_code_trusted(edited)
    assert lm_eval_bridge.remote_code_trusted(edited, trust_remote_code=True) is True

    extra = export_like(tmp_path / "extra")
    (tmp_path / "extra" / "helpers.py").write_text("print('hello')\n")
    with pytest.raises(ValueError, match=r"not linjax's own export code: helpers\.py"):
        lm_eval_bridge.remote_code_trusted(extra)

    elsewhere = export_like(tmp_path / "elsewhere", {**LINJAX_AUTO_MAP,
                                                     "AutoModelForCausalLM": "someone/repo--modeling.Model"})
    with pytest.raises(ValueError, match="code from elsewhere: someone/repo--modeling.Model"):
        lm_eval_bridge.remote_code_trusted(elsewhere)


EVIL_MODELING = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("the folder's code ran")
from transformers import LlamaConfig as MineConfig
"""


def test_lm_eval_does_not_run_a_downloaded_folders_code(tmp_path, capsys):
    """`linjax eval lm-eval ./downloaded-model` on a folder whose config points at its own code: one line,
    exit 2, and the code never ran."""
    require_module("lm_eval", "pip install -e '.[eval]'")
    model = tmp_path / "downloaded-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        "AutoConfig": "modeling_mine.MineConfig", "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}}))
    (model / "modeling_mine.py").write_text(EVIL_MODELING)
    status, _, err = run_cli(["eval", "lm-eval", model, "--tasks", "piqa", "--out", tmp_path / "out"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "modeling_mine.py" in line and "--trust-remote-code" in line
    assert not (model / "RAN").exists()


def test_the_evaluation_digest_covers_the_tokenizer(tmp_path):
    """lm-eval caches request scores by text: a changed tokenizer must not reuse them (nor a resumed run's
    finished tasks)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "merges.txt", "vocab.json"):
        (model / name).write_text(f"{name} v1")
    (model / "README.md").write_text("notes")
    before = lm_eval_bridge.model_digest(str(model))
    (model / "README.md").write_text("other notes")  # decides nothing
    assert lm_eval_bridge.model_digest(str(model)) == before
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "vocab.json"):
        (model / name).write_text(f"{name} v2")
        assert lm_eval_bridge.model_digest(str(model)) != before, name
        (model / name).write_text(f"{name} v1")


@pytest.fixture
def fake_lm_eval(monkeypatch):
    calls = []

    def fake_run(model_spec, *, out_dir, resume, **kwargs):
        calls.append((out_dir, resume))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "lm_eval_results.json"), "w") as f:
            json.dump({"model": model_spec, "run": len(calls)}, f)
        return {"table_markdown": "| task |", "seconds": 0.0}

    monkeypatch.setattr(lm_eval_bridge, "run", fake_run)
    return calls


def test_an_explicit_out_holding_results_needs_overwrite(fake_lm_eval, tmp_path, capsys):
    out = tmp_path / "mine"
    command = ["eval", "lm-eval", "m", "--tasks", "piqa", "--out", out]
    assert run_cli(command, capsys)[0] == 0
    status, _, err = run_cli(command, capsys)
    assert status == 2
    line = one_line_error(err)
    assert str(out) in line and "--overwrite" in line and "--resume" in line
    assert json.loads((out / "lm_eval_results.json").read_text())["run"] == 1  # untouched
    assert run_cli(command + ["--resume"], capsys)[0] == 0
    assert run_cli(command + ["--overwrite"], capsys)[0] == 0
    assert fake_lm_eval == [(str(out), False), (str(out), True), (str(out), False)]
    status, _, err = run_cli(command + ["--resume", "--overwrite"], capsys)
    assert status == 2 and "not allowed with argument" in err


@pytest.mark.parametrize("argv, results", [
    (["eval", "perplexity", "no-such-model", "--data", "d.txt", "--out", "{out}"], "."),
    (["eval", "ruler", "no-such-model", "--out", "{out}"], "."),
    (["eval", "approx", "no-such-model", "s", "--data", "d", "--out", "{out}"], "approx.json"),
    (["eval", "diagnostics", "no-such-model", "--data", "d", "--out", "{out}"], "diagnostics.json"),
    (["eval", "select-layers", "--layers", "4", "--keep", "1", "--out", "{out}"], "."),
])
def test_every_evaluation_keeps_earlier_results_without_overwrite(argv, results, tmp_path, capsys):
    out = tmp_path / "results"
    if results == ".":  # the results are one file
        out.write_text("earlier results\n")
        marker = out
    else:
        out.mkdir()
        marker = out / results
        marker.write_text("earlier results\n")
    argv = [a.format(out=out) for a in argv]
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    line = one_line_error(err)
    assert str(out) in line and "--overwrite" in line
    assert marker.read_text() == "earlier results\n"
    status, _, err = run_cli(argv + ["--overwrite"], capsys)  # gets past the check (to the missing model)
    assert "already holds results" not in err
