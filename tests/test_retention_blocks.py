"""Retained tokens chosen a block at a time (`retain_block` = C > 1; SinksWindow.leaving_block and
block_attend, retention.select, linjax/mixers/linear_retained.py by_blocks).

The partition (every past token in exactly one of sinks, block-aligned window, retained slots, state)
and the layer's output are checked token by token against a brute-force NumPy simulation; then any
split of a sequence (training, prefill pieces, decode) gives the same outputs, gradients flow, and bad
settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.kernels import retention
from tests.test_retention import (
    RETAIN,
    SINKS,
    assert_decode_matches,
    base,  # noqa: F401 (a fixture, requested by name)
    gdn_settings,
    layer_inputs,
    run_in_pieces,
)

WINDOW = 4  # one more than test_retention's, so a block of 4 fits


def settings(**changes):
    return gdn_settings(**{"window": WINDOW, "retain": RETAIN, **changes})


def simulate(inputs, *, sinks, window, retain, block, score, scale):
    """The layer with a block of `block` tokens leaving the window at each boundary, in Python sets and a
    float64 delta rule. Returns (y [T, H, Dv], retained positions per step and kv head, masses [T, T, Hkv]
    as test_retention.simulate's: the probability each position received from the queries that saw it in
    the block-aligned window), asserting the partition at every step."""
    q, k, v, lq, lk, lv, log_alpha, beta = (np.asarray(a, np.float64)[0] for a in inputs)
    T, H, Dk = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    S = np.zeros((H, lk.shape[-1], lv.shape[-1]))
    held = [[] for _ in range(Hkv)]  # (score, position) per kv head
    in_state = [set() for _ in range(Hkv)]
    gate = lambda p: log_alpha[p] if p >= 0 else 0.0  # before the sequence: no decay
    ys, history = np.zeros((T, H, v.shape[-1])), []
    received, masses = np.zeros((T, Hkv)), []
    for t in range(T):
        if t % block == 0:  # a boundary: positions t − w .. t − w + C − 1 leave
            leaving = range(t - window, t - window + block)
            total = sum(gate(p) for p in leaving)
            decayed = S * np.exp(total)[..., None]
            written = []
            for g in range(Hkv):
                recall = lambda j: np.mean([np.linalg.norm(lv[j, g] - lk[j, g] @ decayed[h])
                                            / max(np.linalg.norm(lv[j, g]), 1e-6) for h in range(g * G, (g + 1) * G)])
                # "attention": the i-th leaving token was seen by window − i queries; scaled to `window`
                attention = lambda j: received[j, g] * window / (window - (j - leaving[0]))
                rate = {"key_norm": lambda j: np.linalg.norm(k[j, g]), "attention": attention}.get(score, recall)
                pool = [(s if score in ("key_norm", "attention") else rate(j), j) for s, j in held[g]]
                pool += [(rate(p), p) for p in leaving if p >= sinks]
                pool.sort(key=lambda e: (-e[0], e[1]))  # higher score first, then the older
                held[g] = pool[:retain]
                written.append(sorted(p for _, p in pool[retain:]))
                in_state[g] |= set(written[g])
            for i, p in enumerate(leaving):  # one step per leaving token: its decay, a written token's content
                for h in range(H):
                    g = h // G
                    S[h] = S[h] * (np.exp(log_alpha[p, h])[..., None] if p >= 0 else 1.0)
                    if i < len(written[g]):
                        j = written[g][i]
                        S[h] += beta[j, h] * np.outer(lk[j, g], lv[j, g] - lk[j, g] @ S[h])
        history.append([sorted(p for _, p in held[g]) for g in range(Hkv)])
        first = (t // block + 1) * block - window
        for g in range(Hkv):
            sink_set = set(range(min(sinks, t + 1)))
            window_set = set(range(max(sinks, first, 0), t + 1))
            retained_set = {p for _, p in held[g]}
            places = [sink_set, window_set, retained_set, in_state[g]]
            assert sum(len(p) for p in places) == t + 1 and set().union(*places) == set(range(t + 1)), t
            attended = sorted(sink_set | window_set | retained_set)
            for h in range(g * G, (g + 1) * G):
                logits = k[attended, g] @ q[t, h] / np.sqrt(Dk)
                p = np.exp(logits - logits.max())
                ys[t, h] = p @ v[attended, g] / p.sum() + scale * lq[t, h] @ S[h]
                for j, pj in zip(attended, p / p.sum()):  # the full softmax's probabilities, in the window only
                    received[j, g] += pj / G if j in window_set else 0.0
        masses.append(received.copy())
    return ys, history, np.stack(masses)


@pytest.mark.parametrize("block,score", [(2, "recall"), (4, "recall"), (2, "key_norm"), (2, "attention"),
                                         (4, "attention")])
def test_every_token_is_in_one_place_and_the_layer_matches_a_brute_force_simulation(base, block, score):
    model = linjax.linearize(base, settings(retain_block=block, retain_score=score), seed=1)
    mixer = model.layers[0].attn
    x, positions, inputs = layer_inputs(mixer, 22, base.config.hidden_size)
    expected, history, masses = simulate(inputs, sinks=SINKS, window=WINDOW, retain=RETAIN, block=block,
                                         score=score, scale=mixer.scale)
    assert_decode_matches(mixer, x, positions, expected, history, masses if score == "attention" else None)
    whole = mixer(x[:, :20], positions[:, :20])  # training: blocks scanned, no cache
    np.testing.assert_allclose(np.asarray(whole[0]), np.asarray(mixer.proj.out(
        jnp.asarray(expected[:20], jnp.float32)[None], mixer.lora))[0], atol=2e-5, rtol=1e-4)


def test_select_keeps_the_best_and_writes_the_rest_in_position_order():
    one = jnp.zeros((1, 1, 2))
    cache = retention.empty(1, 2, 1, (one,))
    tag = lambda positions: jnp.asarray(positions, jnp.float32)[None, :, None, None] * jnp.ones((1, 1, 1, 2))
    cache, written, valid = retention.select(cache, (tag([4, 5, 6]),), jnp.array([[[1.0], [3.0], [1.0]]]),
                                             jnp.array([[4, 5, 6]]), jnp.array([[[True], [True], [True]]]))
    assert sorted(np.asarray(cache.position[0, :, 0]).tolist()) == [4, 5]  # ties: the older one stays
    assert np.asarray(written[0][0, :, 0, 0]).tolist() == [6, 0, 0] and np.asarray(valid[0, :, 0]).tolist() == [
        True, False, False]  # the empty slots come back as non-tokens, last
    cache = cache._replace(score=jnp.array([[[1.0], [3.0]]]) if int(cache.position[0, 0, 0]) == 4 else
                           jnp.array([[[3.0], [1.0]]]))
    cache, written, valid = retention.select(cache, (tag([7, 8, 9]),), jnp.array([[[2.0], [0.5], [9.0]]]),
                                             jnp.array([[7, 8, 9]]), jnp.array([[[True], [False], [True]]]))
    assert sorted(np.asarray(cache.position[0, :, 0]).tolist()) == [5, 9]
    assert np.asarray(written[0][0, :, 0, 0]).tolist()[:2] == [4, 7] and np.asarray(valid[0, :, 0]).tolist() == [
        True, True, False]  # the invalid candidate (8) is never kept nor written


@pytest.mark.parametrize("mechanism,score", [("gdn", "recall"), ("gla", "recall"), ("hedgehog", "recall"),
                                             ("gdn", "attention")])
def test_any_split_of_a_sequence_gives_the_same_outputs(base, mechanism, score):
    """Training (no cache), decode token by token, and prefill pieces that start inside a block or at a
    boundary, in any sizes: one model, one set of outputs."""
    model = linjax.linearize(base, settings(mechanism=mechanism, retain_block=4, adapter="shortconv",
                                            retain_score=score), seed=2)
    tokens = jax.random.randint(jax.random.key(4), (2, 27), 0, base.config.vocab_size)
    one_by_one = run_in_pieces(model, tokens, range(28))
    pieces = run_in_pieces(model, tokens, [0, 8, 11, 19, 27])  # 8 at a boundary, 3, then 8 inside a block
    np.testing.assert_allclose(pieces, one_by_one, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model(tokens[:, :24])), one_by_one[:, :24], atol=1e-5)
    np.testing.assert_allclose(np.asarray(model(tokens)), one_by_one, atol=1e-5)  # 6 blocks and 3 tokens


def scan_lengths(jaxpr) -> list[int]:
    """The length of every `lax.scan` in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["length"])
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            found += scan_lengths(inner)
    return found


@pytest.mark.parametrize("length", [24, 23])
def test_training_reads_blocks_whatever_the_length(base, length):
    """A training batch of L tokens predicts from L − 1: a length that is not a multiple of C is read
    as whole blocks and the start of one more, not token by token."""
    model = linjax.linearize(base, settings(retain_block=4), seed=2)
    tokens = jnp.zeros((1, length), jnp.int32)
    assert max(scan_lengths(jax.make_jaxpr(lambda t: model(t))(tokens).jaxpr)) == length // 4


@pytest.mark.parametrize("score", ["recall", "attention"])
def test_training_with_retained_blocks_has_finite_gradients_for_the_new_parameters(base, score):
    from linjax.layers import Trainable

    model = linjax.linearize(base, settings(retain_block=2, adapter="shortconv", retain_score=score), seed=3)
    graphdef, trainable, rest = nnx.split(model, Trainable, ...)
    tokens = jax.random.randint(jax.random.key(5), (1, 16), 0, base.config.vocab_size)

    def loss(trainable):
        logits = nnx.merge(graphdef, trainable, rest)(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    grads = jax.tree.leaves(jax.grad(loss)(trainable))
    assert grads and all(bool(jnp.isfinite(g).all()) for g in grads)
    assert any(float(jnp.abs(g).max()) > 0 for g in grads)


@pytest.mark.parametrize("changes,match", [
    ({"retain_block": 0}, "retain_block"), ({"retain_block": 2, "retain": 0}, "retain > 0"),
    ({"retain_block": WINDOW + 1}, "window ≥ retain_block"), ({"retain_block": 2.0}, "integer")])
def test_bad_retain_block_settings_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        settings(**changes)


def test_ruler_reads_a_model_with_retained_blocks(base):
    from linjax.eval.ruler import budget_variants

    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8), seed=0)
    (label, variant), = budget_variants(model, [128], 8, retain=64, retain_block=8).items()
    assert label == "budget 128 (sinks 8, window 56, retained 64 by recall, in blocks of 8)"
    assert variant.linearize_config.retain_block == 8 and variant.layers[0].attn.sinks_window.retain_block == 8
    with pytest.raises(ValueError, match="needs --retain"):
        budget_variants(model, [128], 8, retain_block=8)
