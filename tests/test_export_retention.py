"""Export parity with retained tokens (docs/retention.md): the PyTorch mirror keeps the same retained
slots as linjax.

Part of tests/test_export.py's parity grid (test_exports_match_linjax_without_jax): its JAX process
builds tiny random models with one layer per linear mechanism and a last softmax layer, exports them
and saves linjax's logits; its PyTorch process (tests/pytorch_side.py, which must never import JAX)
loads the exports and compares. The budget is
sinks 2 + window 4 + retained 3 on 40 tokens, so 34 tokens leave the window and most of them compete
for 3 slots: tokens are admitted, evicted into the state and refused. The tiny models have 4 query
heads on 2 kv heads (GQA).

Checked per score ("recall" with the short conv, "key_norm" with LoRA merged into the projections;
recall with the short conv on both paths, and chosen two tokens at a time, `retain_block` 2; "attention"
token by token with the short conv, and two at a time with LoRA):
the full forward against linjax, the same forward token by token with LinjaxCache and as a prefill
then a chunk then single tokens (each equal to the full forward), greedy generation with the cache
against recomputing the prefix at every step (so, by the parity, linjax's), and cache shapes that
do not grow with the tokens seen. That the retained tokens matter at all is checked on the JAX
side: the same model with retain = 0 gives other logits.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.test_export import SOFTMAX_LAYER, TOLERANCE, build_case

SINKS, WINDOW, RETAIN = 2, 4, 3
SEQUENCE = 40
PROMPT, NEW_TOKENS = 30, 8
# case -> (score, adapter, further settings)
CASES = {"recall": ("recall", "shortconv", {}), "key_norm": ("key_norm", "lora", {}),
         "recall-conv-on-window": ("recall", "shortconv", {"conv_on_window": True}),
         "recall-block2": ("recall", "shortconv", {"retain_block": 2}),
         "attention": ("attention", "shortconv", {}), "attention-block2": ("attention", "lora", {"retain_block": 2})}


def write_retention_cases(root: str):
    """JAX side: export each case to root/<score>/ with its tokens and logits (and how much retain = 0 changes them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import linjax
    from linjax.linearize import with_budget

    jax.config.update("jax_disable_most_optimizations", True)  # compile time dominates here
    tokens = np.random.default_rng(1).integers(0, 128, (2, SEQUENCE)).astype(np.int32)
    forward = nnx.jit(lambda model, t: model(t))
    for name, (score, adapter, extra) in CASES.items():
        model = build_case("llama", adapter, WINDOW, SINKS, seed=3, retain=RETAIN, retain_score=score, **extra)
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
        logits = np.asarray(forward(model, jnp.asarray(tokens)))
        without = np.asarray(forward(with_budget(model, sinks=SINKS, window=WINDOW, retain=0), jnp.asarray(tokens)))
        linjax.save_hf(model, os.path.join(root, name))
        np.savez(os.path.join(root, name + ".npz"), tokens=tokens, logits=logits,
                 retain_changes=np.abs(logits - without).max())
    with open(os.path.join(root, "manifest.json"), "w") as f:  # what tests/pytorch_side.py checks
        json.dump({"retention": list(CASES), "prompt": PROMPT, "new_tokens": NEW_TOKENS}, f)


def check_retention_results(root: str, results: dict):
    """The retained-token cases of tests/test_export.py's parity grid (test_exports_match_linjax_without_jax),
    checked as the module docstring says."""
    for score, (scored_by, _, extra) in CASES.items():
        result = results[score]
        assert result["config"] == {"retain": RETAIN, "retain_score": scored_by,
                                    "conv_on_window": extra.get("conv_on_window", False),
                                    "retain_block": extra.get("retain_block", 1)}
        assert float(np.load(os.path.join(root, score + ".npz"))["retain_changes"]) > 1e-2, \
            f"{score}: retain = 0 gives the same logits, so this case does not exercise the retained slots"
        assert result["max_abs"] <= TOLERANCE, f"{score}: max abs logit difference {result['max_abs']:.2e}"
        assert result["decode_max_abs"] <= TOLERANCE, \
            f"{score}: prefill + decode differs from the full forward by {result['decode_max_abs']:.2e}"
        assert result["repeated_max_abs"] <= TOLERANCE, \
            f"{score}: a cache repeated along the batch continues differently ({result['repeated_max_abs']:.2e})"
        assert result["retained_layers"] == SOFTMAX_LAYER and result["shapes_fixed"], result
        # The first tokens to leave the window (positions 2, 3, 4) filled the slots; later ones took them over.
        assert max(result["held"]) >= SEQUENCE // 2, result["held"]
        assert result["generate_match"], f"{score}: greedy generation with LinjaxCache differs from recomputing"


# ----------------------------------------------------------------------------- the functions, one by one


def test_the_mirrors_scores_and_softmax_parts_match_linjax_kernels():
    """recall_error (per-channel, per-head and no decay; Hedgehog's [v, 1] state), key_norm, the
    retained softmax parts merged with another part and the keys' received probabilities in that
    softmax, on random arrays with 4 query heads on 2 kv heads."""
    import jax.numpy as jnp
    import torch

    from linjax.convert import modeling_linjax_retention as mirror
    from linjax.convert.modeling_linjax_cache import RetainedSlots
    from linjax.kernels import retention
    from linjax.kernels.swa import SoftmaxParts

    rng = np.random.default_rng(0)
    B, N, H, Hkv, D = 2, 3, 4, 2, 8
    state, k, v = rng.normal(size=(B, H, D, D + 1)), rng.normal(size=(B, N, Hkv, D)), rng.normal(size=(B, N, Hkv, D))
    both = lambda x: (jnp.asarray(x, jnp.float32), torch.tensor(x, dtype=torch.float32))
    close = lambda got, want: np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
    for log_decay in (None, -rng.random((B, H, D)), -rng.random((B, H))):
        j, t = zip(*map(both, (state[..., :D], k, v)))
        decay = (None, None) if log_decay is None else both(log_decay)
        close(mirror.recall_error(t[0], t[1], t[2], decay[1]), retention.recall_error(*j, decay[0]))
    ones = np.ones((B, N, Hkv, 1))
    (js, ts), (jk, tk), (jv, tv), (_, tv1) = map(both, (state, k, v, np.concatenate([v, ones], -1)))
    close(mirror.recall_error(ts, tk, tv1, normalized=True), retention.recall_error(js, jk, jv, normalized=True))
    close(mirror.key_norm(tk[:, 0]), retention.key_norm(jk[:, 0]))

    R = 3
    slots = RetainedSlots(R, [tk[:, 0], tv[:, 0]])
    slots.keys, slots.values = torch.tensor(rng.normal(size=(B, R, Hkv, D)), dtype=torch.float32), \
        torch.tensor(rng.normal(size=(B, R, Hkv, D)), dtype=torch.float32)
    slots.position = torch.tensor([[[4, -1], [-1, -1], [7, 2]], [[1, 5], [3, 6], [-1, 8]]])
    (jq, tq), (jn, tn), (jm, tm), (jr, tr) = map(both, (rng.normal(size=(B, H, D)), rng.normal(size=(B, H, D)),
                                                        rng.normal(size=(B, H)), rng.random((B, H)) + 0.5))
    want = retention.merge(SoftmaxParts(jn, jm, jr),
                           retention.attend(jq, jnp.asarray(slots.keys.numpy()), jnp.asarray(slots.values.numpy()),
                                            jnp.asarray(slots.position.numpy(), jnp.int32)))
    for got, expected in zip(mirror.merge((tn, tm, tr), mirror.attend(tq, slots)), want):
        close(got, expected)
    # The "attention" score's increment: one query's probabilities of R window keys in that joint softmax.
    seen = np.array([True, False, True])
    jscores = D ** -0.5 * jnp.einsum("bkgd,brkd->bkgr", jq.reshape(B, Hkv, H // Hkv, D),
                                     jnp.asarray(slots.keys.numpy()))[:, :, :, None]
    per_query = lambda x: x.reshape(B, Hkv, H // Hkv, 1)
    row_max, row_sum = (torch.tensor(np.asarray(x)) for x in want[1:])
    close(mirror.received_mass(tq, slots.keys, torch.tensor(seen), row_max, row_sum),
          retention.received_mass(jscores, seen, per_query(want[1]), per_query(want[2])))


def test_the_mirrors_admission_keeps_linjaxs_tie_rule():
    """Empty slots fill first; an equal score is refused; among equal lowest scores the newest gives way;
    the evicted token's entries are the ones written, per kv head (the second kv head sees other scores)."""
    import torch

    from linjax.convert import modeling_linjax_retention as mirror
    from linjax.convert.modeling_linjax_cache import RetainedSlots

    tag = lambda p: [torch.full((1, 2, 3), float(p)) for _ in range(3)]  # k, v, k' [B, Hkv, D]
    slots = RetainedSlots(2, tag(0))
    offers = [(5, [1.0, 1.0]), (6, [1.0, 3.0]), (7, [1.0, 2.0]), (8, [2.0, 0.5])]
    written = []
    for position, score in offers:
        (k,), valid = mirror.admit(slots, tag(position), torch.tensor([score]), position)
        written.append([float(k[0, g, 0]) if valid[0, g] else None for g in range(2)])
    # kv head 0: 5, 6 fill; 7 ties at 1.0 and is refused; 8 beats 1.0 and evicts 6 (the newer of the tied).
    # kv head 1: 5, 6 fill; 7 (2.0) evicts 5 (1.0); 8 (0.5) is refused.
    assert written == [[None, None], [None, None], [7.0, 5.0], [6.0, 8.0]]
    assert [sorted(slots.position[0, :, g].tolist()) for g in range(2)] == [[5, 8], [6, 7]]
    assert [sorted(slots.keys[0, :, g, 0].tolist()) for g in range(2)] == [[5.0, 8.0], [6.0, 7.0]]


def test_a_hand_edited_config_with_retained_tokens_is_checked():
    from linjax.convert import modeling_linjax as ml

    base = dict(num_hidden_layers=1, linearize={"window": 4, "sinks": 2, "retain": 3})
    with pytest.raises(ValueError, match="window-only mixer has none"):
        ml.LinjaxForCausalLM(ml.LinjaxConfig(mixers=["window"], **base))
    with pytest.raises(ValueError, match="unknown linearize.retain_score"):
        ml.LinjaxForCausalLM(ml.LinjaxConfig(mixers=["gdn"], **{**base, "linearize": {**base["linearize"],
                                                                                      "retain_score": "mass"}}))
    with pytest.raises(ValueError, match="needs window ≥ 1"):
        ml.LinjaxForCausalLM(ml.LinjaxConfig(mixers=["gdn"], num_hidden_layers=1, linearize={"retain": 3}))
