"""Training: frozen weights untouched, optimizer state, configs, packing, kill/resume, sharding."""

import glob
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import linjax
from linjax import train
from linjax.experiment import from_dict, load_experiment
from linjax.layers import Trainable
from linjax.train.data import LocalDocuments, PackedTextDataset
from tests.conftest import ROOT
from tests.helpers import missing

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs")
HUB_FIXTURES = {"meta-llama/Llama-3.1-8B": "llama-3.1-8b.json", "Qwen/Qwen3-8B": "qwen3-8b.json"}


@pytest.fixture
def corpus(tmp_path):
    docs = [{"text": f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(5 + 7 * i))} for i in range(12)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs))
    return str(path)


def experiment(run_dir, source, data, **train_fields):
    fields = dict(steps=6, seq_len=48, batch_size=2, warmup_steps=1, checkpoint_every=2, seed=3)
    fields.update(train_fields)
    return from_dict({"run_dir": str(run_dir), "model": {"source": source},
                      "linearize": {"mechanism": "gdn", "window": 8, "sinks": 2, "adapter": "shortconv"},
                      "data": {"paths": [data]}, "train": fields})


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_frozen_weights_stay_bit_identical_and_adam_keeps_two_moments(tiny_source, corpus, tmp_path):
    from linjax.scan import per_layer, stacked_by_run
    from linjax.train.loop import make_optimizer, make_train_step, place_train_state
    from linjax.train.objectives import objective_loss
    from linjax.train.sharding import make_mesh

    config = experiment(tmp_path / "run", tiny_source, corpus, steps=3)
    trained = train.run(config, progress=False)
    base, _ = linjax.load(tiny_source)
    frozen_filter = nnx.All(nnx.Param, nnx.Not(Trainable))
    before = jax.tree.leaves(nnx.state(base, frozen_filter))
    after = jax.tree.leaves(nnx.state(trained, frozen_filter))
    assert len(before) == len(after) > 0
    for a, b in zip(before, after):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The trained model differs from a fresh linearization only in Trainable parameters.
    fresh = linjax.linearize(base, config.linearize, seed=config.train.seed)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(fresh, Trainable)),
                                                        jax.tree.leaves(nnx.state(trained, Trainable)))]
    assert any(changed)
    # Optimizer state: AdamW's two moments per trainable parameter and nothing for frozen ones.
    optimizer, _ = make_optimizer(config.train, None)
    graphdef, trainable, opt_state, frozen, runs = place_train_state(fresh, optimizer, make_mesh())
    moment_sizes = sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim > 0)
    assert moment_sizes == 2 * linjax.trainable_parameter_count(fresh)
    step = make_train_step(graphdef, optimizer, "ce", make_mesh())
    batch = np.asarray(np.arange(96).reshape(2, 48) % 100, np.int32)
    new_trainable, new_state, metrics = step(trainable, opt_state, frozen, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(optimizer.init(new_trainable))
    # The step on the layer-stacked state is the plain step on per-layer state: same loss, same update.
    per_layer_graphdef, per_layer_trainable, per_layer_frozen = nnx.split(fresh, Trainable, ...)

    def plain_step(params, opt_state):
        (loss, _), grads = jax.value_and_grad(lambda p: objective_loss(
            nnx.merge(per_layer_graphdef, p, per_layer_frozen), batch, "ce"), has_aux=True)(params)
        updates, _ = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates)

    loss, expected = jax.jit(plain_step)(per_layer_trainable, optimizer.init(per_layer_trainable))
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    got = per_layer(new_trainable)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Checkpoints keep the per-layer form, and it converts back exactly.
    checkpoint_form = per_layer(new_state)
    assert jax.tree.structure(checkpoint_form) == jax.tree.structure(optimizer.init(per_layer_trainable))
    back = stacked_by_run(checkpoint_form, runs)
    assert jax.tree.structure(back) == jax.tree.structure(new_state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(new_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_without_a_progress_bar_logs_each_phase(tiny_source, corpus, tmp_path, capfd):
    """--no-progress (a background run's log): plain lines on stdout when the model is ready, after the
    first step (its compilation) and at each checkpoint, so a log shows whether a run is loading,
    compiling or stepping; with the progress bar, none of them. A resumed run says where it starts."""
    train.run(experiment(tmp_path / "quiet", tiny_source, corpus, steps=4), progress=False)
    lines = capfd.readouterr().out.splitlines()
    mine = [line for line in lines if line.startswith("quiet: ")]
    assert "new parameters" in mine[0] and "step 1 of 4 next" in mine[0]
    assert mine[1].startswith("quiet: step 1 took") and "compilation included" in mine[1]
    assert [line.split(":")[1].strip() for line in mine[2:]] == ["step 2 of 4", "step 4 of 4"]
    assert all("checkpoint saved" in line for line in mine[2:])
    train.run(experiment(tmp_path / "quiet", tiny_source, corpus, steps=6), resume=True, progress=False)
    resumed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("quiet: ")]
    assert "step 5 of 6 next" in resumed[0] and resumed[1].startswith("quiet: step 5 took")
    train.run(experiment(tmp_path / "bar", tiny_source, corpus, steps=2), progress=True)
    assert not [line for line in capfd.readouterr().out.splitlines() if line.startswith("bar: ")]


def test_trained_run_directory_restores_with_load(tiny_source, corpus, tmp_path, monkeypatch):
    config = experiment(tmp_path / "run", tiny_source, corpus, steps=2)
    trained = train.run(config, progress=False)
    restored, tokenizer = linjax.load(str(tmp_path / "run"))
    assert tokenizer is not None and restored.linearize_config == config.linearize
    for a, b in zip(jax.tree.leaves(nnx.state(restored)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A run directory relative to the working directory, as `linjax eval ... runs/x` passes it
    # (orbax itself takes absolute paths only).
    monkeypatch.chdir(tmp_path)
    relative, _ = linjax.load("run")
    for a, b in zip(jax.tree.leaves(nnx.state(relative)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and all("loss" in r and "lr" in r for r in records)
    with pytest.raises(FileExistsError, match="--resume"):
        train.run(config, progress=False)


def test_a_second_stage_starts_from_the_first_stages_parameters(tiny_source, corpus, tmp_path):
    first = train.run(experiment(tmp_path / "transfer", tiny_source, corpus, steps=2, objective="attention_transfer"),
                      progress=False)
    # lr 0: the second stage's parameters stay where they started, so they must equal the first's.
    second = train.run(experiment(tmp_path / "ce", tiny_source, corpus, steps=1, warmup_steps=0, lr=0.0,
                                  init_from=str(tmp_path / "transfer")), progress=False)
    fresh = linjax.linearize(linjax.load(tiny_source)[0], first.linearize_config, seed=3)
    for a, b in zip(*(jax.tree.leaves(nnx.state(m, Trainable)) for m in (first, second))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(a, c) for a, c in zip(*(jax.tree.leaves(nnx.state(m, Trainable))
                                                          for m in (first, fresh))))
    other = experiment(tmp_path / "other", tiny_source, corpus, steps=2, init_from=str(tmp_path / "transfer"))
    other = from_dict({**other.to_dict(), "linearize": {**other.linearize.to_dict(), "window": 4}})
    with pytest.raises(ValueError, match="window: 8 there, 4 here"):
        train.run(other, progress=False)
    with pytest.raises(ValueError, match="not a finished training run"):
        train.run(experiment(tmp_path / "x", tiny_source, corpus, steps=2, init_from=str(tmp_path)), progress=False)


def test_a_second_stage_may_add_lora_to_the_first_stages_adapter(tiny_source, corpus, tmp_path):
    """adapter "shortconv+lora" after "shortconv": the first stage's parameters load, LoRA starts at zero
    (so the second stage starts where the first ended) and trains; any other change is still refused."""
    first = train.run(experiment(tmp_path / "ce", tiny_source, corpus, steps=2), progress=False)
    second_config = experiment(tmp_path / "lora", tiny_source, corpus, steps=2, warmup_steps=0,
                               init_from=str(tmp_path / "ce"))
    second_config = from_dict({**second_config.to_dict(),
                               "linearize": {**second_config.linearize.to_dict(), "adapter": "shortconv+lora",
                                             "lora_rank": 4}})  # its own rank: the first stage had no LoRA
    assert second_config.train.learning_rate("shortconv+lora") == 5e-4  # the paper's LoRA rate
    second = train.run(second_config, progress=False)
    without_lora = nnx.All(Trainable, nnx.Not(nnx.PathContains("lora")))
    started = linjax.linearize(linjax.load(tiny_source)[0], second.linearize_config, seed=3)
    from linjax.convert.checkpoint import load_trained_parameters

    load_trained_parameters(started, str(tmp_path / "ce"))
    for a, b in zip(*(jax.tree.leaves(nnx.state(m, without_lora)) for m in (first, started))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ups = lambda m: [x for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(m, Trainable))
                     if "lora" in jax.tree_util.keystr(p) and "_b'" in jax.tree_util.keystr(p)]
    assert ups(started) and all(not np.asarray(b).any() for b in ups(started))  # LoRA's B at zero
    assert all(np.asarray(b).any() for b in ups(second))  # and trained from there
    tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, first.config.vocab_size)
    np.testing.assert_allclose(np.asarray(started(tokens)), np.asarray(first(tokens)), atol=1e-5)
    lora_only = from_dict({**second_config.to_dict(), "run_dir": str(tmp_path / "lora-only"),
                           "linearize": {**second_config.linearize.to_dict(), "adapter": "lora"}})
    with pytest.raises(ValueError, match="adapter: 'shortconv' there, 'lora' here"):
        train.run(lora_only, progress=False)


def test_lolcats_stages_train_the_feature_maps_then_only_lora(tiny_source, corpus, tmp_path):
    """train.trainable: attention transfer with "mechanism" moves Hedgehog's feature maps and gain and
    leaves LoRA as initialised; cross-entropy with "adapter" from that run moves LoRA alone (LoLCATs'
    two stages, configs/claims/lolcats-at.toml then lolcats.toml)."""
    from linjax.train.loop import is_adapter_parameter, trained_parameters

    lolcats = {"mechanism": "hedgehog", "window": 8, "sinks": 0, "adapter": "lora", "output_gain": True}

    def stage(name, **fields):
        config = experiment(tmp_path / name, tiny_source, corpus, steps=2, **fields)
        return from_dict({**config.to_dict(), "linearize": lolcats})

    def parameters(model):
        return [(is_adapter_parameter(path), np.asarray(x))
                for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, Trainable))[0]]

    first = train.run(stage("transfer", objective="attention_transfer", trainable="mechanism"), progress=False)
    second = train.run(stage("ce", trainable="adapter", init_from=str(tmp_path / "transfer")), progress=False)
    fresh = linjax.linearize(linjax.load(tiny_source)[0], first.linearize_config, seed=3)
    fresh, first, second = map(parameters, (fresh, first, second))
    moved = []
    for (adapter, start), (_, after_transfer), (_, after_ce) in zip(fresh, first, second):
        held, trained = (((start, after_transfer), (after_transfer, after_ce)) if adapter else
                         ((after_transfer, after_ce), (start, after_transfer)))
        np.testing.assert_array_equal(*held)  # LoRA through attention transfer, the rest through CE
        moved.append((adapter, not np.array_equal(*trained)))
    assert any(m for adapter, m in moved if adapter) and any(m for adapter, m in moved if not adapter)

    with pytest.raises(ValueError, match="no adapter"):
        from_dict({**stage("x").to_dict(), "linearize": {**lolcats, "adapter": None},
                   "train": {"trainable": "adapter"}})
    liger = linjax.linearize(linjax.load(tiny_source)[0], linjax.LinearizeConfig(
        mechanism="gla", gate="liger_pooled_key", window=8, sinks=0, adapter="lora"))
    with pytest.raises(ValueError, match="selects none"):
        trained_parameters(nnx.state(liger, Trainable), "mechanism")


_TRAINABLE_COUNTS = {}  # (source, linearize settings) -> trainable parameters of the built model


def built_trainable_count(source: str, hf_config: str, settings) -> int:
    """Trainable parameters of `linjax.abstract_model(hf_config, settings)`, built once per model and
    settings: many shipped configs differ only in what the model is built for (seed, steps, data)."""
    key = (source, repr(settings))
    if key not in _TRAINABLE_COUNTS:
        _TRAINABLE_COUNTS[key] = linjax.trainable_parameter_count(linjax.abstract_model(hf_config, settings))
    return _TRAINABLE_COUNTS[key]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.toml"), recursive=True)))
def test_shipped_configs_parse_and_build(path):
    from linjax.convert.sources import source_hf_config

    config = load_experiment(path)
    source = config.model.source
    if source in HUB_FIXTURES:
        hf_config = os.path.join(FIXTURES, HUB_FIXTURES[source])
    else:
        try:
            hf_config = source_hf_config(source)
        except FileNotFoundError as err:
            missing(str(err))  # the embedded model's package: required in CI
    count = built_trainable_count(source, hf_config, config.linearize)
    if config.linearize.mechanism == "window":  # the training-free baseline rows: nothing to train
        assert count == 0
    else:
        assert count > 0


def test_unknown_keys_are_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('run_dir = "x"\n[train]\nstep = 10\n[data]\npaths = ["a"]\n')
    with pytest.raises(ValueError, match=r"unknown key in \[train\]: step"):
        load_experiment(str(path))
    path.write_text('run_dir = "x"\n[linearize]\nmechanismm = "gdn"\n[data]\npaths = ["a"]\n')
    with pytest.raises(ValueError, match="mechanismm"):
        load_experiment(str(path))
    path.write_text('run_dir = "x"\n[optimizer]\nlr = 1\n')
    with pytest.raises(ValueError, match="optimizer"):
        load_experiment(str(path))
    # A section written as a value (`model = "..."` for [model] source = "...") is named as such,
    # not read character by character as keys.
    path.write_text('run_dir = "x"\nmodel = "smollm2-135m"\n')
    with pytest.raises(ValueError, match=r"`model = 'smollm2-135m'` is a value, not a section"):
        load_experiment(str(path))
    path.write_text('run_dir = "x"\nlinearize = "gdn"\n')
    with pytest.raises(ValueError, match=r"\[linearize\]"):
        load_experiment(str(path))
    good = tmp_path / "good.toml"
    good.write_text('run_dir = "x"\n[data]\npaths = ["a"]\n')
    config = load_experiment(str(good), ["train.lr=1e-3", 'linearize.adapter="lora"', "train.steps=7",
                                               "train.warmup_steps=2"])
    assert (config.train.lr, config.linearize.adapter, config.train.steps) == (1e-3, "lora", 7)
    assert load_experiment(str(good)).train.learning_rate("lora") == 5e-4


def test_packing_separates_documents_with_eos_and_survives_resume(corpus, tokenizer):
    documents = LocalDocuments([corpus])
    make = lambda: PackedTextDataset(documents, tokenizer, seq_len=16, batch_size=2, seed=5)
    dataset = make()
    stream = np.concatenate([dataset.next_batch().ravel() for _ in range(12)])
    # Expected: epoch 0's documents in the seed's order, each followed by EOS, then epoch 1's.
    expected = []
    for epoch in range(3):
        for text in documents.iterate(5, epoch, 0):
            expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    np.testing.assert_array_equal(stream, np.asarray(expected[:len(stream)]))
    # Resuming from a saved position continues the stream exactly.
    first = make()
    head = [first.next_batch() for _ in range(5)]
    saved = json.loads(json.dumps(first.state()))
    second = make()
    second.restore(saved)
    tail = [second.next_batch() for _ in range(7)]
    np.testing.assert_array_equal(np.concatenate([b.ravel() for b in head + tail]), stream)


def _train_command(config_path, *extra):
    return [sys.executable, "-m", "linjax.app.cli", "train", str(config_path), "--no-progress", *extra]


def _write_toml(path, config):
    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    raw = config.to_dict()
    lines = [f"run_dir = {value(raw.pop('run_dir'))}"]
    for section, fields in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in fields.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")


# `linjax train` that SIGKILLs itself when the checkpoint save of step AT reaches POINT:
#   before_save    the step's metrics are logged, nothing of its checkpoint is written
#   mid_save       the data position is written into orbax's temporary directory, not yet committed
#   before_commit  every file of the checkpoint is written, orbax's final rename is not done
#   after_save     the checkpoint is committed
KILLING_TRAIN = r"""
import os, signal, sys
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path import async_path

point, at, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

save = ocp.CheckpointManager.save
def killing_save(self, step, *args, **kwargs):
    if point == "before_save" and str(step) == at: die()
    saved = save(self, step, *args, **kwargs)
    if point == "after_save" and str(step) == at: die()
    return saved
ocp.CheckpointManager.save = killing_save

write_json = ocp.handlers.JsonCheckpointHandler._save_fn
async def killing_write_json(self, x, directory):
    await write_json(self, x, directory)
    if point == "mid_save" and f"{at}.orbax-checkpoint-tmp" in str(directory): die()
ocp.handlers.JsonCheckpointHandler._save_fn = killing_write_json

rename = async_path.rename
async def killing_rename(src, dst):
    if point == "before_commit" and os.path.basename(str(dst)) == at: die()
    return await rename(src, dst)
async_path.rename = killing_rename

from linjax.app.cli import main
main(["train", *argv, "--no-progress"])
"""


def completed_checkpoints(run_dir):
    folder = os.path.join(run_dir, "checkpoints")
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit()) if os.path.isdir(folder) else []


@pytest.mark.slow  # five training processes, each killed
def test_sigkill_at_any_point_then_resume_equals_an_uninterrupted_run(tiny_source, corpus, tmp_path):
    """Killed before, inside, at the commit of and after checkpoint saves, one kill per process and each
    started again with --resume: every kill loses only the steps since the last committed checkpoint,
    and the finished run has the uninterrupted run's metrics and trained parameters."""
    steps = 6  # checkpoints at 2, 4 and 6
    reference = train.run(experiment(tmp_path / "reference", tiny_source, corpus, steps=steps), progress=False)
    config = experiment(tmp_path / "killed", tiny_source, corpus, steps=steps)
    config_path = tmp_path / "killed.toml"
    _write_toml(config_path, config)
    # (kill point, step, the committed checkpoints the kill leaves)
    kills = [("before_save", 2, []), ("mid_save", 2, []), ("before_commit", 4, [2]), ("after_save", 4, [2, 4]),
             ("mid_save", 6, [2, 4])]
    for i, (point, at, committed) in enumerate(kills):
        resume = ["--resume"] if i else []
        result = subprocess.run([sys.executable, "-c", KILLING_TRAIN, point, str(at), str(config_path), *resume],
                                cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == -signal.SIGKILL, f"{point} {at}: {result.stderr[-2000:]}"
        assert completed_checkpoints(tmp_path / "killed") == committed, (point, at)
    resumed = train.run(config, resume=True, progress=False)
    assert completed_checkpoints(tmp_path / "killed") == [4, 6]
    assert sorted(os.listdir(tmp_path / "killed" / "checkpoints")) == ["4", "6"]  # no half-written leftovers
    records = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
               for name in ("reference", "killed")}
    assert [r["step"] for r in records["killed"]] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose([r[key] for r in records["killed"]], [r[key] for r in records["reference"]],
                                   rtol=0, atol=1e-6, err_msg=key)
    trained = [jax.tree.leaves(nnx.state(model, Trainable)) for model in (resumed, reference)]
    assert len(trained[0]) == len(trained[1]) > 0
    for got, want in zip(*trained):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_eight_devices_train_like_one(tiny_source, corpus, tmp_path):
    one = experiment(tmp_path / "one", tiny_source, corpus, steps=3, batch_size=8, seq_len=32)
    train.run(one, progress=False)
    config_path = tmp_path / "eight.toml"
    eight = experiment(tmp_path / "eight", tiny_source, corpus, steps=3, batch_size=8, seq_len=32, mesh_fsdp=2)
    _write_toml(config_path, eight)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env,
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "8"
    result = subprocess.run(_train_command(config_path), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    np.testing.assert_allclose(losses(tmp_path / "eight"), losses(tmp_path / "one"), rtol=0, atol=1e-5)


def test_two_processes_train_like_one(tiny_source, corpus, tmp_path):
    """jax.distributed on localhost: two CPU processes (one device each) form one 2-device mesh."""
    import socket

    one = experiment(tmp_path / "one", tiny_source, corpus, steps=3, batch_size=2, seq_len=32)
    train.run(one, progress=False)
    config_path = tmp_path / "two.toml"
    _write_toml(config_path, experiment(tmp_path / "two", tiny_source, corpus, steps=3, batch_size=2, seq_len=32))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = []
    for rank in range(2):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(rank))
        processes.append(subprocess.Popen(_train_command(config_path), cwd=tmp_path, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=600)[1] for p in processes]
    assert all(p.returncode == 0 for p in processes), "\n".join(e[-1500:] for e in errors)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=1e-5)
    restored, _ = linjax.load(str(tmp_path / "two"))
    assert restored.linearize_config == one.linearize


def test_attention_transfer_is_zero_only_where_the_student_is_exact():
    from linjax.config import tiny_config
    from linjax.model import CausalLM
    from linjax.train.objectives import objective_loss

    base = CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)
    exact = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=24, sinks=0))
    approx = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0))
    zero, metrics = objective_loss(exact, tokens, "attention_transfer")
    assert float(zero) < 1e-10 and set(metrics) == {"attention_mse"}
    positive, metrics = objective_loss(approx, tokens, "ce+attention_transfer")
    assert float(metrics["attention_mse"]) > 1e-6 and set(metrics) == {"ce", "attention_mse"}
    assert abs(float(positive) - float(metrics["ce"]) - float(metrics["attention_mse"])) < 1e-5


def test_distillation_is_the_kl_to_the_original_models_next_token_distribution():
    """Against an oracle outside the objective: the unlinearized model's logits and the student's,
    KL computed in float64 with numpy; zero where the student is exact; chunked equals whole; the
    gradient reaches the student's parameters."""
    from linjax.config import tiny_config
    from linjax.model import CausalLM
    from linjax.train.objectives import distillation_loss, objective_loss

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    base = CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)
    teacher = log_softmax(base(tokens))
    exact = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=24, sinks=0))
    student = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=4, sinks=1, adapter="shortconv"))
    assert float(distillation_loss(exact, tokens)) < 1e-6
    oracle = np.mean(np.sum(np.exp(teacher) * (teacher - log_softmax(student(tokens))), -1))
    loss, metrics = objective_loss(student, tokens, "ce+distillation")
    assert oracle > 1e-3 and set(metrics) == {"ce", "distillation_kl"}
    np.testing.assert_allclose(float(metrics["distillation_kl"]), oracle, rtol=1e-4)
    np.testing.assert_allclose(float(distillation_loss(student, tokens, loss_chunk=10)), oracle, rtol=1e-4)
    graphdef, trainable, frozen = nnx.split(student, Trainable, ...)
    grads = jax.grad(lambda t: distillation_loss(nnx.merge(graphdef, t, frozen), tokens))(trainable)
    assert any(float(np.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_attention_transfer_scanned_by_run_equals_the_layer_by_layer_loss():
    """The students run as one scan per run of identical layers; the loss and its gradient equal
    the plain mean over linearized layers, here on a hybrid whose runs are one linear layer, one
    softmax layer and two linear layers."""
    import jax.numpy as jnp

    from linjax.config import tiny_config
    from linjax.mixers.softmax import SoftmaxAttention, pretrained_attention
    from linjax.model import CausalLM, token_positions
    from linjax.scan import layer_runs
    from linjax.train.objectives import attention_transfer_loss

    def layer_by_layer(model, tokens):
        positions = token_positions(tokens)
        teacher = lambda mixer, h, p: jax.lax.stop_gradient(pretrained_attention(mixer.proj, h, p))
        pairs = zip(model.layers, model.attention_activations(tokens, positions, attention=teacher))
        return jnp.mean(jnp.stack([jnp.mean(jnp.square(block.attn(layer.input, positions) - layer.output))
                                   for block, layer in pairs if not isinstance(block.attn, SoftmaxAttention)]))

    base = CausalLM(tiny_config("llama", num_hidden_layers=4), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=8, sinks=2, adapter="shortconv",
                                                           keep_full_attention=(1,)))
    assert layer_runs(model.layers) == [[0], [1], [2, 3]]
    graphdef, trainable, frozen = nnx.split(model, Trainable, ...)
    grads = [jax.grad(lambda t, f=f: f(nnx.merge(graphdef, t, frozen), tokens))(trainable)
             for f in (attention_transfer_loss, layer_by_layer)]
    np.testing.assert_allclose(float(attention_transfer_loss(model, tokens)), float(layer_by_layer(model, tokens)),
                               rtol=1e-6)
    for scanned, plain in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(scanned, plain, rtol=1e-5, atol=1e-8)
