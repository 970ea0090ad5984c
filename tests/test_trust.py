"""Trust: a model directory's own Python runs only when it is linjax's export code or the
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


@pytest.mark.parametrize("file, auto_map, named", [
    ("tokenizer_config.json", {"AutoTokenizer": ["someone/repo--tokenization_x.Tok", None]},
     "code from elsewhere: someone/repo--tokenization_x.Tok (tokenizer_config.json)"),
    ("preprocessor_config.json", {"AutoProcessor": "processing_mine.MineProcessor"},
     "not linjax's export code: processing_mine.MineProcessor (preprocessor_config.json)"),
    ("processor_config.json", {"AutoProcessor": "someone/repo--processing.P"}, "someone/repo--processing.P"),
])
def test_every_auto_map_a_loader_follows_is_checked(file, auto_map, named, tmp_path):
    """A folder that is linjax's export in every other way, but whose tokenizer or processor config names other
    code: transformers would run it under the same trust_remote_code=True."""
    directory = export_like(tmp_path / "model")
    (tmp_path / "model" / file).write_text(json.dumps({"auto_map": auto_map}))
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")) as refused:
        lm_eval_bridge.remote_code_trusted(directory)
    assert "--trust-remote-code" in str(refused.value)
    assert lm_eval_bridge.remote_code_trusted(directory, trust_remote_code=True) is True


def test_a_tokenizers_own_code_is_refused_when_the_config_asks_for_none(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tokenizer_map = {"AutoTokenizer": ["tokenization_mine.T", None]}
    (model / "tokenizer_config.json").write_text(json.dumps({"auto_map": tokenizer_map}))
    (model / "tokenization_mine.py").write_text(EVIL_MODELING)
    with pytest.raises(ValueError, match=r"auto_map in tokenizer_config.json.*tokenization_mine\.py"):
        lm_eval_bridge.remote_code_trusted(str(model))


class RunsCodeWhenUnpickled:
    """What a foreign pickle can do: here, leave a file saying it ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return pathlib.Path(self.marker).write_text, ("unpickled",)


def test_a_foreign_request_cache_is_never_unpickled(tiny_source, shared_data, tmp_path, monkeypatch):
    """lm-eval's request cache is a pickle store: a resumed evaluation in a shared folder must not load a `.db`
    someone put there under its name, even one that holds exactly the requests the evaluation asks."""
    require_module("lm_eval", "pip install -e '.[eval]'")
    from sqlitedict import SqliteDict

    from linjax.eval.shared_prefix_lm import SharedPrefixHFLM

    common = dict(tasks=["arc_easy"], data_dir=shared_data, limit=2)
    reference = lm_eval_bridge.run(tiny_source, out_dir=str(tmp_path / "reference"), **common)
    score = SharedPrefixHFLM._score_continuations
    scored = []

    def killed_after_one(self, *args):
        if scored:
            raise KeyboardInterrupt("killed")
        scored.append(1)
        return score(self, *args)

    out = tmp_path / "shared-folder"
    monkeypatch.setattr(SharedPrefixHFLM, "_score_continuations", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        lm_eval_bridge.run(tiny_source, out_dir=str(out), **common)
    monkeypatch.undo()
    keys = set()  # the requests scored before the kill, from whichever cache the run keeps
    for path in out.glob("lm_eval_requests-*.jsonl"):
        keys |= {json.loads(line)["request"] for line in path.read_text().splitlines() if line.strip()}
    for path in out.glob("lm_eval_requests-*.db"):
        with SqliteDict(str(path)) as cached:
            keys |= set(cached.keys())
    assert keys
    digest = lm_eval_bridge.model_digest(tiny_source)
    marker = tmp_path / "ran"
    with SqliteDict(str(out / f"lm_eval_requests-{digest[:16]}_rank0.db"), autocommit=True) as foreign:
        for key in keys:
            foreign[key] = RunsCodeWhenUnpickled(marker)
    result = lm_eval_bridge.run(tiny_source, out_dir=str(out), resume=True, **common)
    assert not marker.exists()
    assert result["results"]["arc_easy"] == reference["results"]["arc_easy"]
