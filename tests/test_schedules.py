"""train.schedule and train.validation: the cosine schedule as it was, Liger's plateau schedule, its
validation set and keeping the best validation's parameters."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linjax.experiment import TrainSection
from linjax.train import schedules
from linjax.train.validation import IGNORED, PROMPT_NO_INPUT, alpaca_pieces


def plateau_config(**overrides):
    return TrainSection(**{"steps": 100, "seq_len": 32, "warmup_steps": 0, "schedule": "plateau",
                           "validation": "val.json", "weight_decay": 0.01, **overrides})


def test_the_cosine_schedule_and_optimizer_are_the_papers_as_before():
    config = TrainSection(steps=50, seq_len=32, warmup_steps=5, weight_decay=0.01, grad_clip=1.0)
    optimizer, schedule = schedules.make_optimizer(config, 2e-3)
    before = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 5, 50, 0.0)
    assert [float(schedule(s)) for s in range(0, 51, 5)] == [float(before(s)) for s in range(0, 51, 5)]
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(before, weight_decay=0.01))
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    grads = {"w": jnp.full((2, 3), 3.0)}
    new_state, old_state = optimizer.init(params), old.init(params)
    assert jax.tree.structure(new_state) == jax.tree.structure(old_state)  # a saved checkpoint restores into it
    for _ in range(3):
        (new, new_state), (expected, old_state) = (optimizer.update(grads, new_state, params),
                                                   old.update(grads, old_state, params))
        np.testing.assert_array_equal(new["w"], expected["w"])


def test_the_plateau_schedule_cuts_the_rate_as_pytorchs_reduce_on_plateau():
    """mode min, factor 0.1, patience 10, relative threshold 1e-4, min_lr 1e-5 (Liger's scheduler)."""
    optimizer, schedule = schedules.make_optimizer(plateau_config(), 1e-3)
    state = optimizer.init({"w": jnp.ones(3)})
    losses = [3.0, 2.5] + [2.4999] * 11 + [2.0] + [2.1] * 11
    scales = []
    for loss in losses:
        state = schedules.plateau_step(state, loss, 1e-3)
        scales.append(float(schedules.plateau_state(state).scale))
    # 2.4999 is not below 2.5 · (1 − 1e-4): eleven validations without a new best cut the rate on the 11th
    assert scales[:12] == [1.0] * 12 and scales[12] == pytest.approx(0.1)
    # then a new best, eleven more without: the next cut stops at min_lr, 1e-5 = 0.01 · 1e-3
    assert scales[13:24] == [pytest.approx(0.1)] * 11 and scales[24] == pytest.approx(0.01)
    for _ in range(11):
        state = schedules.plateau_step(state, 9.0, 1e-3)
    assert float(schedules.plateau_state(state).scale) == pytest.approx(0.01)  # never below min_lr
    schedule.set_scale(state)
    assert float(schedule(7)) == pytest.approx(1e-5)


def test_the_plateau_scale_multiplies_every_update_weight_decay_included():
    optimizer, _ = schedules.make_optimizer(plateau_config(grad_clip=0), 1e-3)
    params, grads = {"w": jnp.full(4, 2.0)}, {"w": jnp.full(4, 0.5)}
    state = optimizer.init(params)
    full, _ = optimizer.update(grads, state, params)
    cut = state
    for _ in range(12):  # a first best, then eleven validations without a better one
        cut = schedules.plateau_step(cut, 1.0, 1e-3)
    assert float(schedules.plateau_state(cut).scale) == pytest.approx(0.1)
    reduced, _ = optimizer.update(grads, cut, params)
    np.testing.assert_allclose(np.asarray(reduced["w"]), 0.1 * np.asarray(full["w"]), rtol=1e-6)
    # torch's AdamW: the first step moves by lr · (sign of the gradient + weight decay · w)
    np.testing.assert_allclose(np.asarray(full["w"]), -1e-3 * (1 + 0.01 * 2.0), rtol=1e-4)


def test_no_clipping_at_grad_clip_zero():
    optimizer, _ = schedules.make_optimizer(plateau_config(grad_clip=0), 1e-3)
    assert len(optimizer.init({"w": jnp.ones(2)})) == 2  # adamw and the plateau scale, no clipping


@pytest.mark.parametrize("overrides, message", [
    ({"validation": None}, "train.schedule = 'plateau' reads a validation loss"),
    ({"schedule": "cosine", "keep": "best_validation", "validation": None}, "train.keep = 'best_validation' reads"),
    ({"schedule": "step"}, "train.schedule must be one of"),
    ({"keep": "first"}, "train.keep must be one of"),
    ({"grad_clip": -1.0}, "train.grad_clip must be a finite number ≥ 0")])
def test_bad_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        plateau_config(**overrides)
    assert "\n" not in str(error.value)


class WordTokenizer:
    """Each word a token id (its length), EOS 0 at the string "</s>"; BOS 1 with special tokens."""

    eos_token = "</s>"

    def __call__(self, text, add_special_tokens=True):
        ids = [0 if word == "</s>" else 2 + len(word) for word in text.replace("</s>", " </s>").split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_the_validation_set_is_lligers_alpaca_pieces_with_the_prompts_masked(tmp_path):
    records = [{"instruction": f"Say {i}.", "input": "", "output": "word " * (i + 1)} for i in range(6)]
    (tmp_path / "val.json").write_text(json.dumps(records))
    tokenizer = WordTokenizer()
    pieces, targets = alpaca_pieces(str(tmp_path / "val.json"), 4, tokenizer, 8)
    stream, mask = [], []
    for record in records[:4]:
        prompt = tokenizer(PROMPT_NO_INPUT.format_map(record))["input_ids"]
        answer = tokenizer(record["output"] + "</s>", add_special_tokens=False)["input_ids"]
        stream, mask = stream + prompt + answer, mask + [False] * len(prompt) + [True] * len(answer)
    count = (len(stream) - 1) // 8  # pieces while more than a piece is left; the rest dropped
    expected = [(stream[8 * i:8 * i + 8], mask[8 * i:8 * i + 8]) for i in range(count)]
    expected = [(ids, m) for ids, m in expected if any(m)]  # a piece that is all prompt is dropped
    assert [list(p) for p in pieces] == [ids for ids, _ in expected]
    assert [list(t != IGNORED) for t in targets] == [m for _, m in expected]
    assert 0 < len(pieces) < count  # the first pieces are all prompt here
    kept = targets != IGNORED
    assert (pieces[kept] == targets[kept]).all()  # a response token's target is itself


def liger_run(tiny_source, tmp_path, name, steps, **train):
    """The raw config of a tiny Liger-GLA run with validation every step, its best validation kept."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Document {i}: " + " word" * (20 + 9 * i)}) for i in range(8)))
    records = [{"instruction": f"Repeat {i}.", "input": "", "output": " word" * (5 + i)} for i in range(12)]
    (tmp_path / "val.json").write_text(json.dumps(records))
    return {"run_dir": str(tmp_path / name), "model": {"source": tiny_source},
            "linearize": dict(mechanism="gla", gate="liger_pooled_key", combine="mixed", window=8, sinks=0,
                              adapter="lora", lora_alpha=8.0, feature_map="softmax", linear_rope=False,
                              state_covers_window=True, lora_targets=["q", "k", "v"]),
            "data": {"paths": [str(corpus)]},
            "train": dict(steps=steps, seq_len=32, batch_size=1, lr=3e-2, warmup_steps=0, checkpoint_every=2, seed=3,
                          weight_decay=0.01, grad_clip=0, schedule="plateau", validation=str(tmp_path / "val.json"),
                          validation_records=12, validate_every=2, keep="best_validation", keep_checkpoints=3,
                          **train)}


def test_a_run_extended_from_its_checkpoint_validates_as_an_uninterrupted_one(tiny_source, tmp_path):
    from linjax import train
    from linjax.experiment import from_dict

    train.run(from_dict(liger_run(tiny_source, tmp_path, "whole", 6)), progress=False)
    train.run(from_dict(liger_run(tiny_source, tmp_path, "parts", 4)), progress=False)
    train.run(from_dict(liger_run(tiny_source, tmp_path, "parts", 6)), resume=True, progress=False)
    whole, parts = (json.loads((tmp_path / name / "validation.json").read_text()) for name in ("whole", "parts"))
    assert [e["step"] for e in parts["evaluations"]] == [2, 4, 6]
    for a, b in zip(whole["evaluations"], parts["evaluations"]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert parts["kept"] == whole["kept"]


def test_a_run_validates_and_keeps_its_best_validations_parameters(tiny_source, tmp_path):
    """Liger's recipe on a tiny model: the plateau schedule, validation every 2 steps into validation.json, and
    the finished run holds the parameters of the step with the lowest validation loss."""
    import orbax.checkpoint as ocp
    from flax import nnx

    import linjax
    from linjax import train
    from linjax.experiment import from_dict
    from linjax.layers import Trainable

    raw = liger_run(tiny_source, tmp_path, "run", 6)
    train.run(from_dict(raw), progress=False)
    log = json.loads((tmp_path / "run" / "validation.json").read_text())
    assert [e["step"] for e in log["evaluations"]] == [2, 4, 6] and log["pieces"] >= 2
    best = min(log["evaluations"], key=lambda e: e["loss"])
    assert log["best"] == best and log["kept"] == best["step"]
    restored, _ = linjax.load(str(tmp_path / "run"))
    kept = nnx.state(restored, Trainable)
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.restore(str(tmp_path / "run" / "best-validation"))
    saved_leaves = sorted(np.asarray(x).tobytes() for x in jax.tree.leaves(saved))
    assert saved_leaves == sorted(np.asarray(x).tobytes() for x in jax.tree.leaves(kept))
