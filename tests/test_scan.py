"""Scan over layers (linjax/scan.py) against the plain layer loop: forward, decode, gradients, remat."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.model import CausalLM
from linjax.scan import layer_runs

SETTINGS = {
    "full attention": None,
    "pure gdn + shortconv": linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0, adapter="shortconv"),
    "hybrid gla w4 s2, layer 1 kept": linjax.LinearizeConfig(mechanism="gla", window=4, sinks=2,
                                                            keep_full_attention=(1,)),
    "hedgehog + lora": linjax.LinearizeConfig(mechanism="hedgehog", window=4, sinks=2, adapter="lora"),
}


def model_for(setting, kind="llama"):
    model = CausalLM(tiny_config(kind, num_hidden_layers=4), rngs=nnx.Rngs(3))
    config = SETTINGS[setting]
    return model if config is None else linjax.linearize(model, config, seed=5)


def with_mode(model, scan_layers, remat=None):
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    copy.scan_layers, copy.remat = scan_layers, remat
    return copy


def tokens(length, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 128, (2, length)), jnp.int32)


def test_runs_group_identical_consecutive_layers():
    assert layer_runs(model_for("full attention").layers) == [[0, 1, 2, 3]]
    assert layer_runs(model_for("hybrid gla w4 s2, layer 1 kept").layers) == [[0], [1], [2, 3]]


@pytest.mark.parametrize("setting,kind",
                         [(s, "llama") for s in SETTINGS] + [("hybrid gla w4 s2, layer 1 kept", "qwen3")])
def test_scanned_forward_and_gradients_equal_the_loop(setting, kind):
    model = model_for(setting, kind)
    batch = tokens(24)

    def loss_and_grads(scan_layers, remat=None):
        graphdef, state = nnx.split(with_mode(model, scan_layers, remat))

        def loss(state):
            logits = nnx.merge(graphdef, state)(batch).astype(jnp.float32)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return logits, grads

    reference_logits, reference_grads = loss_and_grads("never")
    for mode, remat in [("forward", "dots"), ("always", "full")]:
        logits, grads = loss_and_grads(mode, remat)
        np.testing.assert_allclose(logits, reference_logits, atol=1e-5, rtol=1e-5, err_msg=f"{mode} {remat}")
        # Every parameter's gradient, frozen ones included: the stacking must route each layer's
        # gradient back to that layer.
        for (path, g), (_, r) in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(reference_grads)):
            scale = float(jnp.max(jnp.abs(r))) or 1.0
            np.testing.assert_allclose(g / scale, r / scale, atol=1e-5, err_msg=f"{mode} {remat} {path}")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_scanned_prefill_and_decode_equal_the_loop(setting):
    model = model_for(setting)
    prompt, continuation = tokens(9, seed=1), tokens(3, seed=2)

    def run(scan_layers):
        graphdef, params = nnx.split(with_mode(model, scan_layers))
        forward = jax.jit(lambda params, chunk, states: nnx.merge(graphdef, params)(chunk, states=states))
        states = model.init_states(2, 16)
        logits, states = forward(params, prompt, states)
        outputs = [logits]
        for i in range(continuation.shape[1]):
            logits, states = forward(params, continuation[:, i:i + 1], states)
            outputs.append(logits)
        return jnp.concatenate(outputs, axis=1), states

    reference, reference_states = run("never")
    scanned, scanned_states = run("always")
    np.testing.assert_allclose(scanned, reference, atol=1e-5, rtol=1e-5)
    assert len(scanned_states) == len(reference_states) == 4
    for a, b in zip(jax.tree.leaves(scanned_states), jax.tree.leaves(reference_states)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting", ["hybrid gla w4 s2, layer 1 kept", "hedgehog + lora"])
def test_generate_prefills_with_scanned_layers_and_decodes_like_the_loop(setting):
    """`linjax.generate` runs its prefill pieces with the layers scanned (a block compiled per run of
    identical layers, not per layer) and its one-token steps with the loop: the same tokens as the
    loop everywhere ("never"), through pieces of 8, 4, 2 and 1 tokens."""
    generating = importlib.import_module("linjax.generate")  # the module: linjax.generate is also its function

    model = model_for(setting)
    prompt = tokens(15, seed=4)
    reference = linjax.generate(with_mode(model, "never"), prompt, 5, prefill_chunk=8)
    before = generating._compiled_forward.cache_info().misses
    scanned = linjax.generate(with_mode(model, "forward"), prompt, 5, prefill_chunk=8)
    assert generating._compiled_forward.cache_info().misses == before + 2  # decode's and the scanned prefill's
    np.testing.assert_array_equal(np.asarray(scanned), np.asarray(reference))


def test_prefill_projects_only_the_last_position_onto_the_vocabulary():
    """`generate` needs the next token's logits only: its compiled forward multiplies one position by the
    vocabulary matrix, not every position of the piece (XLA keeps unused rows of a matmul)."""
    generating = importlib.import_module("linjax.generate")
    model = model_for("pure gdn + shortconv")
    graphdef, params = nnx.split(model)
    piece, config = jnp.zeros((1, 64), jnp.int32), model.config

    def flops(forward):
        return forward.lower(params, piece, model.init_states(1, 64)).compile().cost_analysis()["flops"]

    @jax.jit
    def every_position(params, chunk, states):
        logits, states = nnx.merge(graphdef, params)(chunk, states=states)
        return logits[:, -1], states

    saved = flops(every_position) - flops(generating._compiled_forward(graphdef))
    assert saved >= 0.9 * 2 * 63 * config.hidden_size * config.vocab_size


def test_bad_modes_are_refused():
    model = with_mode(model_for("full attention"), "sometimes")
    with pytest.raises(ValueError, match="scan_layers='sometimes'"):
        model(tokens(4))
    with pytest.raises(ValueError, match="remat='all'"):
        with_mode(model_for("full attention"), "forward", "all")(tokens(4))
