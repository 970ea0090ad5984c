"""Retained tokens (docs/retention.md; kernels/retention.py, SinksWindow.retaining_step, mixers/linear_retained.py
by_tokens).

The partition (every past token in exactly one of sinks, window, retained slots, state) is checked
token by token against a brute-force NumPy simulation of the whole layer: its sets, its delta-rule
state and its output. Then prefill + decode = decode, fixed cache shapes, retain = 0 as before, and a
trained run's parameters loading with retain on."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.convert.checkpoint import load_trained_parameters, save_trained
from linjax.kernels import retention
from linjax.layers import Trainable
from linjax.linearize import with_budget
from linjax.mixers.linear_retained import by_tokens
from linjax.model import CausalLM

SINKS, WINDOW, RETAIN = 2, 3, 3


@pytest.fixture(scope="module")
def base():
    return CausalLM(tiny_config("llama", num_hidden_layers=1), rngs=nnx.Rngs(0))


def gdn_settings(**changes):
    return linjax.LinearizeConfig(**{"mechanism": "gdn", "window": WINDOW, "sinks": SINKS, "adapter": None,
                                     **changes})


def jitted_mixer(mixer):
    graphdef, params = nnx.split(mixer)
    return jax.jit(lambda params, x, positions, state: nnx.merge(graphdef, params)(x, positions, state)), params


def simulate(inputs, *, sinks, window, retain, score, scale):
    """The layer with retained tokens, one token at a time, with Python sets and a float64 delta rule.
    Returns (y [T, H, Dv], retained positions per step and kv head, masses [T, T, Hkv]: after each step,
    the softmax probability every position has received from the queries that saw it in the window,
    averaged over the query heads), asserting the partition."""
    q, k, v, lq, lk, lv, log_alpha, beta = (np.asarray(a, np.float64)[0] for a in inputs)
    T, H, Dk = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    S = np.zeros((H, lk.shape[-1], lv.shape[-1]))
    held = [[] for _ in range(Hkv)]  # (score, position) per kv head
    in_state = [set() for _ in range(Hkv)]
    ys, history = np.zeros((T, H, v.shape[-1])), []
    received, masses = np.zeros((T, Hkv)), []
    for t in range(T):
        leaving = t - window
        decayed = S * np.exp(log_alpha[leaving] if leaving >= 0 else 0.0)[..., None]
        written = [None] * Hkv
        if leaving >= sinks:
            for g in range(Hkv):
                # recall: against the state at this step, for the leaving token and every retained one
                recall = lambda j: np.mean([np.linalg.norm(lv[j, g] - lk[j, g] @ decayed[h])
                                            / max(np.linalg.norm(lv[j, g]), 1e-6) for h in range(g * G, (g + 1) * G)])
                if score == "key_norm":
                    s = np.linalg.norm(k[leaving, g])
                elif score == "attention":  # fixed once in a slot: the held tokens keep theirs
                    s = received[leaving, g]
                else:
                    s = recall(leaving)
                    held[g] = [(recall(j), j) for _, j in held[g]]
                if len(held[g]) < retain:
                    held[g].append((s, leaving))
                else:
                    weakest = min(held[g], key=lambda e: (e[0], -e[1]))  # ties: the newer one goes
                    if s > weakest[0]:
                        held[g].remove(weakest)
                        held[g].append((s, leaving))
                        written[g] = weakest[1]
                    else:
                        written[g] = leaving
        for h in range(H):
            g, j = h // G, written[h // G]
            S[h] = decayed[h]
            if j is not None:
                S[h] += beta[j, h] * np.outer(lk[j, g], lv[j, g] - lk[j, g] @ decayed[h])
        history.append([sorted(p for _, p in held[g]) for g in range(Hkv)])
        for g in range(Hkv):
            if written[g] is not None:
                in_state[g].add(written[g])
            sink_set = set(range(min(sinks, t + 1)))
            window_set = set(range(max(sinks, t - window + 1), t + 1))
            retained_set = {p for _, p in held[g]}
            places = [sink_set, window_set, retained_set, in_state[g]]
            assert sum(len(p) for p in places) == t + 1 and set().union(*places) == set(range(t + 1))
            attended = sorted(sink_set | window_set | retained_set)
            for h in range(g * G, (g + 1) * G):
                logits = k[attended, g] @ q[t, h] / np.sqrt(Dk)
                p = np.exp(logits - logits.max())
                ys[t, h] = p @ v[attended, g] / p.sum() + scale * lq[t, h] @ S[h]
                for j, pj in zip(attended, p / p.sum()):  # the full softmax's probabilities, in the window only
                    received[j, g] += pj / G if j in window_set else 0.0
        masses.append(received.copy())
    return ys, history, np.stack(masses)


@pytest.mark.parametrize("score", ["recall", "key_norm", "attention"])
def test_every_token_is_in_one_place_and_the_layer_matches_a_brute_force_simulation(base, score):
    model = linjax.linearize(base, gdn_settings(retain=RETAIN, retain_score=score), seed=1)
    mixer = model.layers[0].attn
    x, positions, inputs = layer_inputs(mixer, 18, base.config.hidden_size)
    expected, history, masses = simulate(inputs, sinks=SINKS, window=WINDOW, retain=RETAIN, score=score,
                                         scale=mixer.scale)
    assert_decode_matches(mixer, x, positions, expected, history, masses if score == "attention" else None)


def layer_inputs(mixer, T: int, hidden: int):
    """A random input x [1, T, hidden], its positions, and what the simulations read: the pretrained
    q, k, v, the linear part's q', k', v and its gates."""
    x = jax.random.normal(jax.random.key(3), (1, T, hidden))
    positions = jnp.arange(T)[None]
    q, k, v = mixer.proj.qkv(x, positions, mixer.lora)
    lq, lk = mixer.features(q, k)
    log_alpha, beta = mixer.gates(x, lk)
    return x, positions, (q, k, v, lq, lk, v, log_alpha, beta)


def assert_decode_matches(mixer, x, positions, expected, history, masses=None):
    """Decoding x token by token holds the simulation's retained positions (per kv head) and gives its
    outputs at every step; the slots fill and the kv heads keep different tokens. With `masses` (the
    "attention" score), the cache's ring of masses holds the simulation's at every step: slot r the
    mass of the latest position ≡ r (mod window), still in the window or left at the last boundary."""
    assert any(len(h[0]) == RETAIN for h in history) and history[-1][0] != history[-1][1]
    step, params = jitted_mixer(mixer)
    state = mixer.init_state(1, x.shape[1])
    W = mixer.sinks_window.window
    for t in range(x.shape[1]):
        out, state = step(params, x[:, t:t + 1], positions[:, t:t + 1], state)
        held = np.asarray(state.window.retained.position[0])  # [R, Hkv]
        assert [sorted(p for p in held[:, g] if p >= 0) for g in range(held.shape[1])] == history[t], t
        if masses is not None:
            ring_position = t - (t - np.arange(W)) % W
            want = np.where(ring_position[:, None] >= 0, masses[t][np.maximum(ring_position, 0)], 0.0)
            np.testing.assert_allclose(np.asarray(state.window.mass[0]), want, atol=1e-6, err_msg=str(t))
        want = mixer.proj.out(jnp.asarray(expected[t][None, None], jnp.float32), mixer.lora)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=1e-4)


def test_with_one_slot_the_token_that_received_the_most_attention_is_retained(base):
    """R = 1 and the "attention" score: after every step the slot holds, per kv head, the token that
    received the largest softmax mass (from the full probabilities, brute force) of all the tokens that
    have left the window, the older among equals; and the cache holds a mass ring only for this score."""
    model = linjax.linearize(base, gdn_settings(retain=1, retain_score="attention"), seed=4)
    mixer = model.layers[0].attn
    # Tokens 6, 9 and 12 scaled up draw more attention, so the slot changes hands (else the first token
    # to leave keeps it: it was seen by the smallest softmaxes, when the window was not yet full).
    x, positions, _ = layer_inputs(mixer, 16, base.config.hidden_size)
    x = x.at[:, jnp.array([6, 9, 12])].multiply(8.0)
    q, k, v = mixer.proj.qkv(x, positions, mixer.lora)
    lq, lk = mixer.features(q, k)
    inputs = (q, k, v, lq, lk, v, *mixer.gates(x, lk))
    _, _, masses = simulate(inputs, sinks=SINKS, window=WINDOW, retain=1, score="attention", scale=mixer.scale)
    step, params = jitted_mixer(mixer)
    state = mixer.init_state(1, x.shape[1])
    kept = set()
    for t in range(x.shape[1]):
        _, state = step(params, x[:, t:t + 1], positions[:, t:t + 1], state)
        left = np.arange(SINKS, t - WINDOW + 1)  # the tokens that have left the window (not sinks)
        if len(left):
            # a token's mass is final once it has left: read it at the last step
            best = left[np.argmax(masses[-1][left], axis=0)]
            assert np.asarray(state.window.retained.position[0, 0]).tolist() == best.tolist(), t
            kept |= set(best.tolist())
    assert len(kept) >= 3  # the slot changed hands
    assert linjax.linearize(base, gdn_settings(retain=1)).init_states(1, 8)[0].window.mass is None


def test_received_mass_is_the_joint_softmaxs_probability_summed_over_queries_and_averaged_over_heads():
    """retention.received_mass against jax.nn.softmax over every key a query reads: the probabilities of
    one block of keys, normalised by the whole row (the other keys too), masked where not read."""
    B, Hkv, G, n, K, other = 2, 2, 3, 4, 5, 6
    scores = jax.random.normal(jax.random.key(0), (B, Hkv, G, n, K)) * 3
    rest = jax.random.normal(jax.random.key(1), (B, Hkv, G, n, other)) * 3  # e.g. sinks and retained keys
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (n, K))
    full = jax.nn.softmax(jnp.concatenate([jnp.where(mask, scores, -jnp.inf), rest], axis=-1), axis=-1)
    row_max = jnp.maximum(jnp.where(mask, scores, -jnp.inf).max(-1), rest.max(-1))
    row_sum = (jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0).sum(-1)
               + jnp.exp(rest - row_max[..., None]).sum(-1))
    want = np.moveaxis(np.asarray(full[..., :K]).sum(3).mean(2), 1, 2)  # [B, K, Hkv]
    np.testing.assert_allclose(np.asarray(retention.received_mass(scores, mask, row_max, row_sum)), want,
                               rtol=1e-5, atol=1e-7)


def test_ties_keep_the_older_token_and_empty_slots_fill_first():
    one = jnp.zeros((1, 1, 2))  # entries: one array per kv head, B = 1, Hkv = 1
    cache = retention.empty(1, 2, 1, (one,))
    tag = lambda p: jnp.full((1, 1, 2), float(p))
    for position, score in [(5, 1.0), (6, 1.0)]:  # two empty slots: both admitted, nothing written
        cache, written, written_valid = retention.admit(cache, (tag(position),), jnp.array([[score]]),
                                                        position, True)
        assert not bool(written_valid[0, 0])
    cache, written, written_valid = retention.admit(cache, (tag(7),), jnp.array([[1.0]]), 7, True)
    assert bool(written_valid[0, 0]) and float(written[0][0, 0, 0]) == 7  # equal score: refused
    cache, written, written_valid = retention.admit(cache, (tag(8),), jnp.array([[2.0]]), 8, True)
    assert float(written[0][0, 0, 0]) == 6  # the newer of the two tied slots gives way
    assert sorted(np.asarray(cache.position[0, :, 0]).tolist()) == [5, 8]
    cache, written, written_valid = retention.admit(cache, (tag(9),), jnp.array([[9.0]]), 9, False)
    assert not bool(written_valid[0, 0]) and sorted(np.asarray(cache.position[0, :, 0]).tolist()) == [5, 8]


def run_in_pieces(model, tokens, boundaries):
    """The model's logits over `tokens` [B, T], fed through its cache in the pieces between consecutive
    `boundaries` (0 first, T last): range(T + 1) decodes token by token."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda params, tokens, states: nnx.merge(graphdef, params)(tokens, states=states))
    boundaries = list(boundaries)
    states, pieces = model.init_states(*tokens.shape), []
    for start, end in zip(boundaries, boundaries[1:]):
        logits, states = forward(params, tokens[:, start:end], states)
        pieces.append(logits)
    return np.concatenate(pieces, axis=1)


@pytest.mark.parametrize("mechanism,score,conv_on_window", [
    ("gdn", "recall", False), ("gdn", "key_norm", False), ("gla", "recall", False), ("hedgehog", "recall", False),
    ("gdn", "recall", True), ("gdn", "attention", False), ("hedgehog", "attention", False)])
def test_prefill_then_decode_equals_decoding_the_whole_prompt(base, mechanism, score, conv_on_window):
    settings = gdn_settings(mechanism=mechanism, retain=RETAIN, retain_score=score, adapter="shortconv",
                            conv_on_window=conv_on_window)
    model = linjax.linearize(base, settings, seed=2)
    tokens = jax.random.randint(jax.random.key(4), (2, 20), 0, base.config.vocab_size)
    one_by_one = run_in_pieces(model, tokens, range(21))
    np.testing.assert_allclose(run_in_pieces(model, tokens, [0, *range(13, 21)]), one_by_one, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model(tokens)), one_by_one, atol=1e-5)  # no cache: the same scan


def test_cache_shapes_do_not_depend_on_the_sequence_length(base):
    model = linjax.linearize(base, gdn_settings(retain=RETAIN, adapter="shortconv"))
    shapes = lambda states: [x.shape for x in jax.tree.leaves(states)]
    short, long = model.init_states(1, 16), model.init_states(1, 1 << 16)
    assert shapes(short) == shapes(long)
    retained = short[0].window.retained
    assert retained.position.shape == (1, RETAIN, base.config.num_key_value_heads)
    tokens = jnp.zeros((1, 24), jnp.int32)
    _, after = model(tokens, states=model.init_states(1, 24))
    assert shapes(after) == shapes(short)


def test_retain_zero_is_the_final_recipe_as_before(base):
    default = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=WINDOW, sinks=SINKS), seed=5)
    explicit = linjax.linearize(base, gdn_settings(retain=0), seed=5)
    tokens = jax.random.randint(jax.random.key(6), (1, 16), 0, base.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(default(tokens)), np.asarray(explicit(tokens)))
    # The scan the retaining path uses, with no slots, is today's chunked mixer.
    mixer = explicit.layers[0].attn
    x = jax.random.normal(jax.random.key(7), (1, 16, base.config.hidden_size))
    positions = jnp.arange(16)[None]
    state = mixer.init_state(1, 16)
    chunked, _ = mixer(x, positions, state)
    scanned, _ = by_tokens(mixer, x, positions, state, retain_nothing=True)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(chunked), atol=1e-5)


def test_a_trained_runs_parameters_load_with_retain_on(base, tmp_path):
    settings = gdn_settings(adapter="shortconv")
    trained = linjax.linearize(base, settings, seed=8)
    params = nnx.state(trained, Trainable)
    nnx.update(trained, jax.tree.map(lambda a: a + 0.01, params))
    save_trained(trained, str(tmp_path / "run"), base_source="tiny", dtype="float32")
    retaining = linjax.linearize(base, dataclasses.replace(settings, retain=4), seed=9)
    load_trained_parameters(retaining, str(tmp_path / "run"))
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(trained, Trainable),
                        nnx.state(retaining, Trainable))
    assert all(jax.tree.leaves(same))
    # Or on a loaded model, at its budget or another one.
    widened = with_budget(trained, sinks=SINKS, window=WINDOW, retain=4)
    assert widened.linearize_config.retain == 4 and widened.layers[0].attn.sinks_window.retain == 4
    tokens = jnp.zeros((1, 12), jnp.int32)
    np.testing.assert_allclose(np.asarray(widened(tokens)), np.asarray(retaining(tokens)), atol=1e-6)


@pytest.mark.parametrize("settings,match", [
    (dict(retain=-1), "retain must be an integer ≥ 0"),
    (dict(retain=True), "retain must be an integer ≥ 0"),
    (dict(retain=2.5), "retain must be an integer ≥ 0"),
    (dict(retain_score="mass"), "unknown retain_score"),
    (dict(retain=4, window=0, sinks=0), "needs window ≥ 1 and a linear mechanism"),
    (dict(retain=4, mechanism="window"), "needs window ≥ 1 and a linear mechanism"),
])
def test_bad_retain_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        linjax.LinearizeConfig(**settings)


def test_retain_is_a_setting_of_experiment_files(tmp_path):
    from linjax.experiment import load_experiment

    path = tmp_path / "run.toml"
    path.write_text('run_dir = "x"\n[data]\npaths = ["a"]\n')
    config = load_experiment(str(path), ["linearize.retain=64", 'linearize.retain_score="key_norm"'])
    assert (config.linearize.retain, config.linearize.retain_score) == (64, "key_norm")
    with pytest.raises(ValueError, match="retain must be an integer ≥ 0"):
        load_experiment(str(path), ["linearize.retain=-3"])


def test_the_pytorch_export_carries_the_retained_tokens_settings(base, tmp_path):
    """The export writes retain and retain_score into config.json (the mirror keeps the slots as linjax:
    tests/test_export_retention.py)."""
    import json

    from linjax.convert.export import export_hf

    model = linjax.linearize(base, gdn_settings(retain=2, retain_score="key_norm"))
    export_hf(model, str(tmp_path / "export"))
    with open(tmp_path / "export" / "config.json") as f:
        settings = json.load(f)["linearize"]
    assert (settings["retain"], settings["retain_score"]) == (2, "key_norm")
    assert (tmp_path / "export" / "modeling_linjax_retention.py").exists()
