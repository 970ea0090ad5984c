"""LAMBADA (OpenAI) scored in JAX: lm-eval's `lambada_openai`, without the export to PyTorch.

Each example asks for its text's last word given the rest. As lm-eval builds the request, the
context is the text up to its last space and the target " " + the last word, encoded as lm-eval's
causal-model `_encode_pair` does: the whole text is encoded and the context's own tokens split off
the front, so the target's tokens are the whole encoding's remainder. An example is correct when
every target token is the model's greedy choice (lm-eval's `acc`); perplexity is exp(−mean over
examples of the target's log-likelihood) (its `perplexity` aggregation). tests/test_lambada.py checks
both, example by example, against lm-eval's HFLM on the same model exported to PyTorch.

Examples are scored in batches, right-padded to a multiple of `PAD_TO` tokens (a model is causal,
so a position never sees the padding after it), which bounds the compiled shapes to a handful; only
the positions that predict a target token are projected onto the vocabulary.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from linjax import heartbeat

PAD_TO = 64
TARGETS_TO = 8  # target positions per row, a multiple of this: one compiled shape for nearly every batch


def read_texts(data_dir: str, limit: int | None = None) -> list[str]:
    """The texts of data_dir/lambada/lambada_test.jsonl (the 5,153 of LAMBADA's OpenAI test set), the first `limit`."""
    path = os.path.join(data_dir, "lambada", "lambada_test.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no LAMBADA test file at {path}; --data-dir takes the data folder that holds "
                                "lambada/lambada_test.jsonl")
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
                if limit is not None and len(texts) == limit:
                    break
    return texts


def encode(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(context tokens, target tokens) of one example, as lm-eval encodes them for a causal model."""
    if " " not in text:
        raise ValueError(f"a LAMBADA example must have a context before its last word; got {text!r}")
    context, last_word = text.rsplit(" ", 1)
    kept = context.rstrip()  # trailing whitespace moves from the context to the target, as lm-eval does
    context, target = kept, context[len(kept):] + " " + last_word
    whole = tokenizer.encode(context + target)
    context_tokens = tokenizer.encode(context)
    return context_tokens, whole[len(context_tokens):]


def target_scores_function(model):
    """(tokens [B, L], at [B, K]) -> (log-probability of the token after each position in `at`, whether
    it is the greedy choice) [B, K], compiled once per shape. Only those K positions are projected onto
    the vocabulary: the targets are a passage's last few tokens."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def target_scores(state, tokens, at):
        model = nnx.merge(graphdef, state)
        hidden = jnp.take_along_axis(model.hidden_states(tokens[:, :-1]), at[..., None], axis=1)
        logits = model.logits(hidden).astype(jnp.float32)
        targets = jnp.take_along_axis(tokens, at + 1, axis=1)
        chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
        return chosen, jnp.argmax(logits, axis=-1) == targets

    def call(tokens, at):
        chosen, greedy = target_scores(state, jnp.asarray(tokens), jnp.asarray(at))
        return np.asarray(chosen, np.float64), np.asarray(greedy)

    return call


def score(model, tokenizer, texts: list[str], batch_size: int = 8, progress: bool = False,
          on_batch=None, done: int = 0) -> list[dict]:
    """Per example {"loglikelihood", "greedy", "target_tokens"} for texts[done:]; `on_batch(results so
    far)` after every batch (to save them)."""
    scores = target_scores_function(model)
    results = []
    with tqdm(total=len(texts), initial=done, desc="lambada", disable=not progress) as bar:
        for start in range(done, len(texts), batch_size):
            pairs = [encode(tokenizer, text) for text in texts[start:start + batch_size]]
            longest = max(len(c) + len(t) for c, t in pairs)
            tokens = np.zeros((batch_size, -(-longest // PAD_TO) * PAD_TO), np.int32)  # whole batches: one shape
            # The positions predicting each target token, padded by repeating a row's last one.
            at = np.zeros((batch_size, -(-max(len(t) for _, t in pairs) // TARGETS_TO) * TARGETS_TO), np.int32)
            for row, (context, target) in enumerate(pairs):
                tokens[row, :len(context) + len(target)] = context + target
                at[row] = len(context) + np.minimum(np.arange(at.shape[1]), len(target) - 1) - 1
            chosen, greedy = scores(tokens, at)
            for row, (_, target) in enumerate(pairs):
                results.append({"loglikelihood": float(chosen[row, :len(target)].sum()),
                                "greedy": bool(greedy[row, :len(target)].all()), "target_tokens": len(target)})
            bar.update(len(pairs))
            heartbeat.progress()
            if on_batch:
                on_batch(results)
    return results


def summary(examples: list[dict]) -> dict:
    """lm-eval's figures over the examples scored: acc (and its standard error, the sample standard
    deviation over √n) and perplexity."""
    n = len(examples)
    correct = np.array([e["greedy"] for e in examples], np.float64)
    acc = float(correct.mean())
    return {"scored": n, "acc": acc,
            "acc_stderr": float(correct.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
            "perplexity": math.exp(-float(np.mean([e["loglikelihood"] for e in examples])))}
