"""Reliability: no command loses a user's work, and every mistake gets one clear line.

- Outputs: `linjax export`, `convert` and `linearize` replace only a directory linjax wrote as an
  output (it holds `.linjax-export`, listing its entries), never their input nor a run directory,
  and swap a new output in whole (a checkpoint's parameters and manifest are replaced together).
- A full disk during an export, a checkpoint save or a training checkpoint leaves the earlier
  output or the last completed checkpoint intact and ends with one line (simulated, or a file standing
  where a folder must be made: the tests run as root, where a read-only folder does not stop writes).
- Bad numbers and lists on the command line are refused by the parser; user errors exit with 2.
- `linjax eval lm-eval` without --out writes beside the model (or under runs/) and never over
  earlier results unless --resume.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from linjax.app.cli import main


def run_cli(argv, capsys):
    """(exit status, stdout, stderr) of `linjax ARGV` run in this process."""
    try:
        main([str(a) for a in argv])
        status = 0
    except SystemExit as done:
        status = done.code
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(err: str) -> str:
    """The error line; fails unless stderr is exactly one line of it (no traceback)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def snapshot(directory) -> dict:
    """{relative path: sha256} of every file under `directory`."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return files


def leftovers(parent) -> list[str]:
    """Staging or set-aside directories a write left beside its output."""
    return [n for n in os.listdir(parent) if ".linjax-new-" in n or ".linjax-old-" in n]


@pytest.fixture
def plain_hf_dir(tiny_source, tmp_path):
    """A user's own HF model directory (not written by linjax: no marker), with a file of theirs."""
    directory = tmp_path / "users-model"
    shutil.copytree(tiny_source, directory)
    (directory / ".linjax-export").unlink(missing_ok=True)
    (directory / "NOTES.md").write_text("my notes\n")
    return directory


@pytest.fixture
def run_directory(tmp_path):
    """What a training run directory holds (config.json too, which the old check took for an export)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "checkpoints" / "2" / "state").write_bytes(b"days of accelerator time")
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "train": {"steps": 2}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (run / "linjax.json").write_text(json.dumps({"format_version": 1, "kind": "trained"}))
    return run


# ----------------------------------------------------------------------------- 1. what an output may replace


@pytest.mark.parametrize("command", ["export", "convert"])
@pytest.mark.parametrize("where", ["same", "inside input", "holds input"])
def test_output_overlapping_the_input_is_refused(command, where, plain_hf_dir, capsys):
    out = {"same": plain_hf_dir, "inside input": plain_hf_dir / "hf",
           "holds input": plain_hf_dir.parent}[where]
    before = snapshot(plain_hf_dir.parent)
    status, _, err = run_cli([command, plain_hf_dir, "--out", out], capsys)
    assert status == 2
    assert "input" in one_line_error(err) and "--out" in err
    assert snapshot(plain_hf_dir.parent) == before


@pytest.mark.parametrize("command", ["export", "convert", "linearize"])
def test_a_run_directory_is_never_replaced(command, tiny_source, run_directory, capsys):
    before = snapshot(run_directory)
    status, _, err = run_cli([command, tiny_source, "--out", run_directory], capsys)
    assert status == 2
    assert "training run" in one_line_error(err) and "another --out" in err
    assert snapshot(run_directory) == before


def test_a_directory_linjax_did_not_write_is_never_replaced(tiny_source, plain_hf_dir, capsys):
    before = snapshot(plain_hf_dir)
    status, _, err = run_cli(["export", tiny_source, "--out", plain_hf_dir], capsys)
    assert status == 2 and "did not write" in one_line_error(err)
    assert snapshot(plain_hf_dir) == before


def test_an_earlier_export_is_replaced_until_something_is_added(tiny_source, tmp_path, capsys):
    out = tmp_path / "export"
    for command in ("export", "convert", "export"):  # each replaces the previous one whole
        status, _, err = run_cli([command, tiny_source, "--out", out], capsys)
        assert status == 0, err
    assert not (out / "linjax.json").exists()  # convert's checkpoint went with the rest
    assert json.loads((out / ".linjax-export").read_text())["entries"]
    assert leftovers(tmp_path) == []
    (out / "lm_eval").mkdir()  # e.g. results written into the export later
    (out / "lm_eval" / "results.md").write_text("scores\n")
    status, _, err = run_cli(["export", tiny_source, "--out", out], capsys)
    assert status == 2 and "lm_eval" in one_line_error(err)
    assert (out / "lm_eval" / "results.md").exists()


# ----------------------------------------------------------------------------- 3. checkpoints replaced whole


def tiny_model(seed: int):
    from flax import nnx

    from linjax.config import tiny_config
    from linjax.model import CausalLM

    return CausalLM(tiny_config("llama", vocab_size=64), rngs=nnx.Rngs(seed))


def embedding(model):
    return np.asarray(model.embed_tokens.embedding[...])


def test_an_interrupted_checkpoint_overwrite_leaves_the_earlier_checkpoint(tmp_path, monkeypatch):
    """The manifest is written after the parameters: failing there must not leave the new parameters
    beside the old manifest (which loads silently when the shapes agree)."""
    from linjax.convert import checkpoint

    directory = str(tmp_path / "ckpt")
    first, second = tiny_model(0), tiny_model(1)
    checkpoint.save_checkpoint(first, directory)
    dump = json.dump

    def failing_dump(obj, f, *args, **kwargs):
        if os.path.basename(getattr(f, "name", "")).startswith(checkpoint.MANIFEST):
            raise OSError(errno.ENOSPC, "No space left on device")
        return dump(obj, f, *args, **kwargs)

    monkeypatch.setattr(json, "dump", failing_dump)
    with pytest.raises(OSError) as failure:
        checkpoint.save_checkpoint(second, directory)
    monkeypatch.undo()
    loaded, _ = checkpoint.load_checkpoint(directory)
    np.testing.assert_array_equal(embedding(loaded), embedding(first))
    assert "No space left on device" in str(failure.value) and "intact" in str(failure.value)
    assert leftovers(tmp_path) == []
    checkpoint.save_checkpoint(second, directory)  # a save that completes replaces it
    np.testing.assert_array_equal(embedding(checkpoint.load_checkpoint(directory)[0]), embedding(second))


# ----------------------------------------------------------------------------- 11. full disk, unwritable folder


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_full_disk_during_export_keeps_the_previous_export(command, tiny_source, tmp_path, monkeypatch, capsys):
    import safetensors.numpy

    out = tmp_path / "export"
    assert run_cli([command, tiny_source, "--out", out], capsys)[0] == 0
    before = snapshot(out)
    save_file = safetensors.numpy.save_file

    def disk_fills_up(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_fills_up)
    status, _, err = run_cli([command, tiny_source, "--out", out], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "No space left on device" in line and "intact" in line and str(out) in line
    assert line.count("could not write") == 1
    assert snapshot(out) == before
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)


def test_a_crash_inside_the_swap_restores_the_previous_export(tiny_source, tmp_path, monkeypatch):
    """Renaming the new export into place fails after the old one was moved aside: it comes back."""
    import linjax
    from linjax import files

    out = str(tmp_path / "export")
    model, tokenizer = linjax.load(tiny_source)
    linjax.save_hf(model, out, tokenizer)
    before = snapshot(out)
    rename = os.rename

    def failing_rename(src, dst):
        if ".linjax-new-" in os.path.basename(str(src)) and str(dst) == out:
            raise OSError(errno.EIO, "Input/output error")
        return rename(src, dst)

    monkeypatch.setattr(files.os, "rename", failing_rename)
    with pytest.raises(OSError, match="intact"):
        linjax.save_hf(model, out, tokenizer)
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["export", "convert", "linearize"])
def test_an_unwritable_output_folder_is_one_line(command, tiny_source, tmp_path, capsys):
    """A file stands where the output's folder must be created: no user can write there, root included
    (a read-only folder would not stop root, which is how the suite runs in CI)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file of the user's\n")
    status, _, err = run_cli([command, tiny_source, "--out", blocker / "model"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "could not write" in line and str(blocker) in line
    assert blocker.read_text() == "a file of the user's\n"


TRAIN_TOML = """run_dir = "{run}"
[model]
source = "{source}"
[linearize]
mechanism = "gdn"
window = 8
sinks = 2
adapter = "shortconv"
[data]
paths = ["{data}"]
[train]
steps = 4
seq_len = 32
batch_size = 2
warmup_steps = 1
checkpoint_every = 2
seed = 3
"""


def write_training_experiment(tmp_path, source):
    """A 4-step TRAIN_TOML experiment on 8 small documents in `tmp_path`: (run directory, config path)."""
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(40))})
                              for i in range(8)))
    run = tmp_path / "run"
    config = tmp_path / "experiment.toml"
    config.write_text(TRAIN_TOML.format(run=run, source=source, data=data))
    return run, config


def test_a_full_disk_during_a_training_checkpoint_keeps_the_last_one(tiny_source, tmp_path, monkeypatch, capsys):
    import orbax.checkpoint as ocp

    from linjax import train

    run, config = write_training_experiment(tmp_path, tiny_source)
    save_fn = ocp.handlers.JsonCheckpointHandler._save_fn

    async def disk_fills_up_at_step_4(self, x, directory):
        if "4.orbax-checkpoint-tmp" in str(directory):  # step 4's parameters are written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return await save_fn(self, x, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", disk_fills_up_at_step_4)
    status, _, err = run_cli(["train", config, "--no-progress"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "No space left on device" in line and "intact" in line and "--resume" in line
    steps = sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit())
    assert steps == [2]
    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", save_fn)
    train.run(train.load_experiment(str(config), [], []), resume=True, progress=False)  # step 2 restores
    assert sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit()) == [2, 4]


# ----------------------------------------------------------------------------- 5. bad input: one line, status 2


@pytest.mark.parametrize("argv, option", [
    (["eval", "ruler", "m", "--lengths", ",", "--out", "x.json"], "--lengths"),
    (["eval", "ruler", "m", "--lengths", "1024,x", "--out", "x.json"], "--lengths"),
    (["eval", "ruler", "m", "--budgets", "0", "--out", "x.json"], "--budgets"),
    (["eval", "perplexity", "m", "--data", "d.txt", "--max-windows", "0"], "--max-windows"),
    (["eval", "perplexity", "m", "--data", "d.txt", "--seq-len", "0"], "--seq-len"),
    (["eval", "approx", "t", "s", "--data", "d", "--num-seqs", "-2", "--out", "o"], "--num-seqs"),
    (["eval", "lm-eval", "m", "--tasks", ","], "--tasks"),
    (["eval", "lm-eval", "m", "--tasks", "piqa", "--limit", "0"], "--limit"),
    (["generate", "m", "--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["linearize", "m", "--window", "-8", "--out", "o"], "--window"),
    (["bench", "latency", "--lengths", "0,16"], "--lengths"),
    (["bench", "latency", "--batch", "0"], "--batch"),
    (["bench", "latency", "--implementations", "full,nope"], "--implementations"),
])
def test_bad_numbers_and_lists_are_refused_by_the_parser(argv, option, capsys):
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    assert "Traceback" not in err
    assert f"error: argument {option}" in err.strip().splitlines()[-1]  # after argparse's usage line


def test_the_scale_flag_takes_a_number_or_fla_default(capsys):
    from linjax.app.cli import build_parser

    for text, want in (("1", 1.0), ("0.088", 0.088), ("fla_default", "fla_default")):
        assert build_parser().parse_args(["linearize", "m", "--scale", text, "--out", "o"]).scale == want
    status, _, err = run_cli(["linearize", "m", "--scale", "half", "--out", "o"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "scale must be a finite number > 0, or 'fla_default'" in line and "'half'" in line


def test_a_gguf_file_missing_metadata_is_one_line(tmp_path, monkeypatch, capsys):
    import gguf

    monkeypatch.setenv("LINJAX_CACHE", str(tmp_path / "cache"))
    path = str(tmp_path / "incomplete.gguf")
    writer = gguf.GGUFWriter(path, "llama")  # no block_count, feed_forward_length, ...
    writer.add_head_count(4)
    writer.add_embedding_length(64)
    writer.add_vocab_size(97)
    writer.add_tensor("token_embd.weight", np.zeros((97, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    status, _, err = run_cli(["convert", path, "--out", tmp_path / "out"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "incomplete.gguf" in line and "'llama.feed_forward_length'" in line and "convert" in line
    assert not (tmp_path / "out").exists()


def test_a_missing_model_exits_with_status_2(tmp_path, capsys):
    status, _, err = run_cli(["export", tmp_path / "no-such-model", "--out", tmp_path / "out"], capsys)
    assert status == 2 and "not found" in one_line_error(err)


# ----------------------------------------------------------------------------- 6. lm-eval's default output


def test_lm_eval_writes_to_a_default_directory_and_never_over_earlier_results(tmp_path, monkeypatch, capsys):
    from linjax.eval import lm_eval_bridge

    calls = []

    def fake_run(model_spec, *, out_dir, resume, **kwargs):
        calls.append((out_dir, resume))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "lm_eval_results.json"), "w") as f:
            json.dump({"model": model_spec}, f)
        return {"table_markdown": "| task |", "seconds": 0.0}

    monkeypatch.setattr(lm_eval_bridge, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    expected = [(model / "lm_eval", False), (model / "lm_eval-2", False), (model / "lm_eval-2", True)]
    for i, (directory, resume) in enumerate(expected):
        status, out, err = run_cli(["eval", "lm-eval", model, "--tasks", "piqa"] + ["--resume"] * resume, capsys)
        assert status == 0, err
        assert calls[i] == (str(directory), resume)
        assert str(directory) in out  # says where it writes
    status, out, err = run_cli(["eval", "lm-eval", "HuggingFaceTB/SmolLM2-135M", "--tasks", "piqa"], capsys)
    assert status == 0, err
    assert calls[-1] == (str(tmp_path / "runs" / "lm-eval" / "HuggingFaceTB--SmolLM2-135M"), False)
    status, out, err = run_cli(["eval", "lm-eval", "m", "--tasks", "piqa", "--out", tmp_path / "mine"], capsys)
    assert calls[-1] == (str(tmp_path / "mine"), False)


# ----------------------------------------------------------------------------- 7. switches, lengths, homes


@pytest.mark.parametrize("text, expected", [("", False), ("0", False), ("false", False), ("False", False),
                                            ("no", False), ("off", False), (" OFF ", False), ("1", True),
                                            ("true", True), ("Yes", True), ("on", True)])
def test_boolean_environment_variables_are_parsed_as_booleans(text, expected, monkeypatch):
    from linjax import fingerprint
    from linjax.app import compilation_cache, hugepages

    monkeypatch.setenv("LINJAX_ALLOW_CHANGED_INPUTS", text)
    assert fingerprint.allowed() is expected
    switched = {"LINJAX_COMPILATION_CACHE": text, "LINJAX_HUGE_PAGES": text, "JAX_COMPILATION_CACHE_DIR": ""}
    on = text.strip() == "" or expected  # both default to on
    assert (compilation_cache.folder(switched) is not None) is on
    if not on:
        assert hugepages.environment_with_huge_pages(switched) is None


def test_a_boolean_environment_variable_of_another_value_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("LINJAX_ALLOW_CHANGED_INPUTS", "maybe")
    from linjax import fingerprint

    with pytest.raises(ValueError, match="LINJAX_ALLOW_CHANGED_INPUTS='maybe' is not a boolean"):
        fingerprint.allowed()
    monkeypatch.delenv("LINJAX_ALLOW_CHANGED_INPUTS")
    monkeypatch.setenv("LINJAX_HUGE_PAGES", "2")
    from linjax.app import hugepages

    with pytest.raises(ValueError, match="LINJAX_HUGE_PAGES='2' is not a boolean; set it to one of 1/true/yes/on"):
        hugepages.environment_with_huge_pages()


def test_a_generation_longer_than_memory_allows_is_refused_before_allocating(tiny_source, capsys):
    """A KV cache for 10^13 positions (petabytes): one line naming the length, not an allocator's traceback."""
    status, out, err = run_cli(["generate", tiny_source, "--prompt", "Hello", "--max-new-tokens", str(10 ** 13)],
                               capsys)
    line = one_line_error(err)
    assert status == 2 and "10,000,000,000,000 tokens" in line and "free" in line and "fewer new tokens" in line
    assert "Hello" not in out  # refused before the prompt was printed or anything decoded


def test_no_home_directory_is_one_line_not_a_folder_named_tilde(tmp_path, monkeypatch, capsys):
    """Without HOME (and a user the password database does not know), `~` does not expand: the cache would
    have gone into a folder named `~` in the working directory."""
    import pwd

    from tests.test_bad_input import write_gguf

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("LINJAX_CACHE", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(["convert", write_gguf(tmp_path / "model.gguf"), "--out", tmp_path / "out"], capsys)
    line = one_line_error(err)
    assert status == 2 and "HOME is not set" in line and "LINJAX_CACHE" in line
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


@pytest.mark.parametrize("command", ["export", "convert", "linearize"])
@pytest.mark.parametrize("how", ["itself", "a link to it"])
def test_an_output_that_is_the_model_folder_is_refused(command, how, plain_hf_dir, tmp_path, capsys):
    out = plain_hf_dir
    if how == "a link to it":
        out = tmp_path / "link"
        out.symlink_to(plain_hf_dir)
    before = snapshot(plain_hf_dir)
    status, _, err = run_cli([command, out if how == "itself" else plain_hf_dir, "--out", out], capsys)
    line = one_line_error(err)
    assert status == 2 and "is the input" in line
    assert snapshot(plain_hf_dir) == before and os.path.islink(out) == (how == "a link to it")
