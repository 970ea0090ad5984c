"""A validation loss while training (`train.validation`): what the plateau schedule reads, and the best
checkpoint a run may keep instead of its last (`train.keep = "best_validation"`), as Liger's trainer does.

The validation set is Liger's (its training/dataloader.py): the first `validation_records` records of a
Clean-Alpaca JSON file, each written in the Alpaca prompt template, its prompt then its response and EOS;
the records are concatenated and cut into pieces of `train.seq_len` tokens (the rest dropped), and the
loss is the cross-entropy of the response tokens only (the prompts' are masked), averaged over a piece's
tokens and then over the pieces.

Every `validate_every` steps the loss is computed and written to RUN_DIR/validation.json; a new best saves
the trainable parameters to RUN_DIR/best-validation/ (before the step's checkpoint, so a run killed in
between computes and saves the same again when resumed). Runs start from step 0 with none of it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax.files import write_json
from linjax.scan import per_layer, stacked_by_run, unstack_layers
from linjax.train import schedules, sharding
from linjax.train.cross_entropy import cross_entropy

# Liger's (and Stanford Alpaca's) prompt template.
PROMPT_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.\n\n"
                   "### Instruction:\n{instruction}\n\n### Response:\n")
IGNORED = -100  # a target that counts for nothing (a prompt token)
BEST = "best-validation"
LOG = "validation.json"


def alpaca_pieces(path: str, records: int, tokenizer, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n, seq_len], targets [n, seq_len]): the first `records` Alpaca records, templated, tokenized
    (the prompt with the tokenizer's special tokens, the response and EOS without), concatenated and cut into
    pieces; a target is the token itself where it is a response token and IGNORED in a prompt. A ValueError
    if they make no piece with a response token."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)[:records]
    tokens, targets = [], []
    for row in rows:
        template = PROMPT_INPUT if row.get("input", "") else PROMPT_NO_INPUT
        prompt = tokenizer(template.format_map(row), add_special_tokens=True)["input_ids"]
        answer = tokenizer(f"{row['output']}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
        tokens += prompt + answer
        targets += [IGNORED] * len(prompt) + answer
    count = (len(tokens) - 1) // seq_len  # Liger cuts a piece while more than one piece is left, then drops the rest
    pieces = np.asarray(tokens[:count * seq_len], np.int32).reshape(count, seq_len)
    masks = np.asarray(targets[:count * seq_len], np.int64).reshape(count, seq_len)
    useful = (masks != IGNORED).any(axis=1)  # Liger drops a piece that is all prompt
    if not useful.any():
        raise ValueError(f"{path}: the first {records} records make no {seq_len}-token piece with a response token")
    return pieces[useful], masks[useful]


class Validation:
    """The validation of one run: `after_step` each step (validates when due, feeds the plateau schedule,
    saves a new best), `kept` at the end (the parameters the run keeps)."""

    def __init__(self, config, tokenizer, graphdef, frozen, runs, mesh, run_dir, schedule, opt_state):
        tc = config.train
        self.every, self.keep_best, self.run_dir = tc.validate_every, tc.keep == "best_validation", run_dir
        self.peak_lr = tc.learning_rate(config.linearize.adapter)
        self.runs, self.mesh, self.schedule = runs, mesh, schedule
        pieces, masks = alpaca_pieces(tc.validation, tc.validation_records, tokenizer, tc.seq_len)
        self.pieces = [sharding.put_batch(p[None], mesh) for p in pieces]
        self.masks = [jnp.asarray(m[None, 1:] != IGNORED) for m in masks]
        self.about = {"data": os.path.abspath(tc.validation), "records": tc.validation_records,
                      "seq_len": tc.seq_len, "pieces": len(pieces), "every": self.every,
                      "keep": tc.keep, "schedule": tc.schedule}
        self.log = None  # read at the first step: a resumed run drops what was logged after its checkpoint
        self.frozen = frozen

        def loss(trainable, frozen, tokens, mask):
            model = nnx.merge(graphdef, unstack_layers(trainable), unstack_layers(frozen))
            per_token = cross_entropy(model.logits(model.hidden_states(tokens[:, :-1])).astype(jnp.float32),
                                      tokens[:, 1:])
            return jnp.sum(per_token * mask) / jnp.sum(mask)

        self.loss = jax.jit(loss)
        schedule.set_scale(opt_state)

    @classmethod
    def create(cls, config, tokenizer, graphdef, frozen, runs, mesh, run_dir, schedule, opt_state):
        """The run's Validation, or None when `train.validation` is not set."""
        if config.train.validation is None:
            return None
        return cls(config, tokenizer, graphdef, frozen, runs, mesh, run_dir, schedule, opt_state)

    def _read_log(self, first_step: int) -> dict:
        path = os.path.join(self.run_dir, LOG)
        log = {**self.about, "evaluations": [], "best": None}
        if os.path.exists(path):
            with open(path) as f:
                earlier = json.load(f)
            log["evaluations"] = [e for e in earlier.get("evaluations", []) if e["step"] < first_step]
            done = log["evaluations"]
            log["best"] = min(done, key=lambda e: e["loss"]) if done else None
        return log

    def validation_loss(self, trainable) -> float:
        losses = [float(self.loss(trainable, self.frozen, p, m)) for p, m in zip(self.pieces, self.masks)]
        return float(np.mean(losses))

    def after_step(self, step: int, trainable, opt_state):
        """After training step `step`: at a multiple of `every`, the validation loss, logged; the plateau
        schedule's state advanced by it; a new best saved. Returns the optimizer state."""
        if self.log is None:
            self.log = self._read_log(step)
        if step % self.every:
            return opt_state
        loss = self.validation_loss(trainable)
        if schedules.plateau_state(opt_state) is not None:
            opt_state = sharding.replicate(schedules.plateau_step(opt_state, loss, self.peak_lr), self.mesh)
        self.schedule.set_scale(opt_state)
        best = self.log["best"]
        entry = {"step": step, "loss": loss, "lr": float(self.schedule(step))}
        self.log["evaluations"].append(entry)
        if best is None or loss < best["loss"]:
            self.log["best"] = entry
            if self.keep_best and jax.process_index() == 0:
                self._save_best(trainable)
        if jax.process_index() == 0:
            write_json(os.path.join(self.run_dir, LOG), self.log)
        return opt_state

    def _save_best(self, trainable):
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(self.run_dir, BEST), per_layer(trainable), force=True)

    def kept(self, trainable):
        """The parameters the run keeps: its best validation's (with keep "best_validation" and a best
        saved), else `trainable` as it is. The choice is written to validation.json."""
        if self.log is None:
            self.log = self._read_log(10 ** 12)
        best = self.log["best"]
        if self.keep_best and best is not None:
            import orbax.checkpoint as ocp

            with ocp.StandardCheckpointer() as checkpointer:
                restored = checkpointer.restore(os.path.join(self.run_dir, BEST), per_layer(trainable))
            trainable = sharding.replicate(stacked_by_run(restored, self.runs), self.mesh)
            self.log["kept"] = best["step"]
        else:
            self.log["kept"] = "last"
        if jax.process_index() == 0:
            write_json(os.path.join(self.run_dir, LOG), self.log)
        return trainable
