"""Every input a user can get wrong ends with one line and exit status 2: damaged
model files, model configs with impossible values, experiment numbers out of range, flags, and a
training run whose loss stops being finite."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.test_reliability import TRAIN_TOML, one_line_error, run_cli, write_training_experiment

# ----------------------------------------------------------------------------- model files


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny plain LLaMA saved as an HF directory, without a tokenizer."""
    from flax import nnx

    import linjax
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    model = CausalLM(tiny_config("llama", vocab_size=64, eos_token_id=2), rngs=nnx.Rngs(0))
    return linjax.save_hf(model, str(tmp_path_factory.mktemp("tiny") / "model"))


def users_copy(source, tmp_path):
    """A user's own model directory: linjax's record of what it wrote (.linjax-export) is not there, so the
    edits below reach the checks they test, not the check that the files are as linjax wrote them."""
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    (directory / ".linjax-export").unlink()
    return directory


def test_a_truncated_safetensors_file_is_one_line(tiny_hf_dir, tmp_path, capsys):
    model = users_copy(tiny_hf_dir, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut short
    status, _, err = run_cli(["convert", model, "--out", tmp_path / "out"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert str(weights) in line and "truncated" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", ['{"metadata": {}}', '{"weight_map": []}', "[1, 2]", "{not json"])
def test_a_broken_safetensors_index_is_one_line(index, tiny_hf_dir, tmp_path, capsys):
    model = users_copy(tiny_hf_dir, tmp_path)
    (model / "model.safetensors.index.json").write_text(index)
    status, _, err = run_cli(["convert", model, "--out", tmp_path / "out"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "model.safetensors.index.json" in line and "weight_map" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, named", [
    ("num_key_value_heads", 0, "num_key_value_heads"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("eos_token_id", 64, "eos_token_id"),  # one past the vocabulary
    ("eos_token_id", -1, "eos_token_id"),
    ("eos_token_id", "</s>", "eos_token_id"),
    ("hidden_size", "64", "hidden_size"),
    ("vocab_size", None, "vocab_size"),
    ("auto_map", {"AutoModelForCausalLM": "modeling_mine.MyModel"}, "auto_map"),
])
def test_impossible_model_config_values_are_one_line(field, value, named, tiny_hf_dir, tmp_path, capsys):
    model = users_copy(tiny_hf_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    status, _, err = run_cli(["convert", model, "--out", tmp_path / "out"], capsys)
    assert status == 2
    assert named in one_line_error(err)


def write_gguf(path, *, head_count=2, head_count_kv=1, eos=2, vocab=16):
    """A complete tiny LLaMA GGUF (1 layer, width 8) with the given metadata, which linjax loads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(head_count)
    if isinstance(head_count_kv, list):
        writer.add_array("llama.attention.head_count_kv", head_count_kv)
    else:
        writer.add_head_count_kv(head_count_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)  # the tokenizer derives its merges from them
    writer.add_eos_token_id(eos)
    shapes = {"token_embd.weight": (vocab, 8), "output_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8),
              "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8),
              "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16),
              "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("metadata, named", [
    ({"head_count_kv": [1]}, "'llama.attention.head_count_kv' is a per-layer list"),
    ({"head_count": 0}, "'llama.attention.head_count' must be an integer ≥ 1"),
    ({"head_count_kv": 0}, "'llama.attention.head_count_kv' must be an integer ≥ 1"),
    ({"eos": 99}, "eos_token_id"),
])
def test_impossible_gguf_metadata_is_one_line(metadata, named, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LINJAX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "model.gguf", **metadata)
    status, _, err = run_cli(["convert", path, "--out", tmp_path / "out"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "model.gguf" in line and named in line
    assert not (tmp_path / "out").exists()


def test_a_special_token_outside_the_gguf_vocabulary_is_one_line(tmp_path):
    """The tokenizer reads its special tokens by id: an id past the token list is named, not an IndexError."""
    from linjax.convert.gguf import load_gguf_tokenizer

    path = write_gguf(tmp_path / "model.gguf", eos=99)
    with pytest.raises(ValueError, match="tokenizer.ggml.eos_token_id' is 99, not one of the file's 16 tokens"):
        load_gguf_tokenizer(path)


# ----------------------------------------------------------------------------- experiment files and flags


@pytest.mark.parametrize("setting, named", [
    ("train.lr=-1e-3", "train.lr must be a finite number ≥ 0"),
    ("train.lr=nan", "train.lr must be"),
    ("train.lr=inf", "train.lr must be"),
    ("train.steps=0", "train.steps must be an integer ≥ 1"),
    ("train.steps=2.5", "train.steps must be an integer"),
    ('train.steps="10"', "train.steps must be an integer"),
    ("train.batch_size=0", "train.batch_size must be"),
    ("train.batch_size=true", "train.batch_size must be an integer"),
    ("train.warmup_steps=4", "train.warmup_steps must be in [0, steps=4)"),
    ("train.warmup_steps=-1", "train.warmup_steps must be"),
    ("train.weight_decay=-0.1", "train.weight_decay must be a finite number ≥ 0"),
    ("train.grad_clip=-1", "train.grad_clip must be a finite number ≥ 0"),  # 0: no clipping
    ("train.seed=-1", "train.seed must be an integer ≥ 0"),
    ("train.mesh_data=0", "train.mesh_data must be ≥ 1, or -1"),
    ("train.mesh_fsdp=0", "train.mesh_fsdp must be"),
    ('model.dtype="float64"', "model.dtype must be one of ['auto', 'float32', 'bfloat16', 'float16']"),
    ('data.paths="corpus.txt"', "data.paths must be a list"),
    ("data.shuffle_buffer=0", "data.shuffle_buffer must be"),
    ("data.deduplicate=1", "data.deduplicate must be true or false"),
    ("eval.ruler_samples=0", "eval.ruler_samples must be"),
    ("eval.ruler_lengths=[1024, 0]", "eval.ruler_lengths[1] must be an integer ≥ 1"),
    ("eval.perplexity_seq_len=1", "eval.perplexity_seq_len must be an integer ≥ 2"),
    ("eval.lm_eval_limit=-5", "eval.lm_eval_limit must be"),
    ("eval.compare=1", "eval.compare must be true or false"),
    ('run_dir=""', "run_dir is empty"),
])
def test_experiment_numbers_are_range_checked_where_parsed(setting, named, tmp_path, capsys):
    config = tmp_path / "experiment.toml"
    config.write_text(TRAIN_TOML.format(run=tmp_path / "run", source="no-such-model", data="corpus.txt"))
    status, _, err = run_cli(["train", config, "--set", setting], capsys)
    assert status == 2
    line = one_line_error(err)
    assert named in line and "experiment.toml" in line
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize("argv", [
    ["train", "x.toml", "--watchdog", "nan"],
    ["train", "x.toml", "--watchdog", "inf"],
    ["run", "x.toml", "--watchdog", "-1"],
    ["eval", "ruler", "m", "--out", "x.json", "--watchdog", "nan"],
    ["linearize", "m", "--out", "o", "--seed", "-1"],
    ["generate", "m", "--prompt", "hi", "--seed", "-3"],
    ["bench", "latency", "--seed", "-1"],
])
def test_flags_are_range_checked_by_the_parser(argv, capsys):
    status, _, err = run_cli(argv, capsys)
    assert status == 2 and "Traceback" not in err
    assert f"error: argument {argv[-2]}" in err.strip().splitlines()[-1]


def test_a_watchdog_of_nan_seconds_is_refused():
    """nan compares false with everything: such a watchdog never fires and its thread spins."""
    from linjax.app import watchdog

    for seconds in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"), watchdog.watch("stage", seconds):
            pass


# ----------------------------------------------------------------------------- a loss that stops being finite


def test_a_non_finite_loss_stops_training_with_one_line_and_saves_nothing_broken(tiny_source, tmp_path,
                                                                                 monkeypatch, capsys):
    from linjax.train import loop

    run, config = write_training_experiment(tmp_path, tiny_source)
    make_train_step = loop.make_train_step

    def diverging_at_step_3(*args, **kwargs):
        step, calls = make_train_step(*args, **kwargs), []

        def wrapped(trainable, opt_state, frozen, batch):
            calls.append(None)
            trainable, opt_state, metrics = step(trainable, opt_state, frozen, batch)
            if len(calls) == 3:
                metrics = {**metrics, "loss": metrics["loss"] * float("nan")}
            return trainable, opt_state, metrics

        return wrapped

    monkeypatch.setattr(loop, "make_train_step", diverging_at_step_3)
    status, _, err = run_cli(["train", config, "--no-progress"], capsys)
    assert status == 2
    line = one_line_error(err)
    assert "diverged at step 3" in line and "loss nan" in line and "checkpoint (step 2) is intact" in line
    assert sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit()) == [2]
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (run / "trainable").exists() and not (run / "linjax.json").exists()
