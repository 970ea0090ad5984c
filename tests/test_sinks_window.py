"""SinksWindow (linjax/mixers/sinks_window.py): settings, pass-through without a window, its cache,
and `with_budget` building new ones instead of changing a model in place. Its numerics are covered
by the decode-equals-forward grid (tests/test_linearize.py) and the export tests."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.linearize import with_budget
from linjax.mixers.sinks_window import SinksWindow, SinksWindowCache
from linjax.mixers.softmax import SoftmaxAttention
from linjax.model import CausalLM


def test_without_a_window_the_linear_inputs_pass_through():
    inputs = (jnp.ones((1, 5, 2, 4)), jnp.zeros((1, 5, 2, 4)))
    parts, shifted, cache = SinksWindow(sinks=0, window=0)(None, None, None, linear_inputs=inputs)
    assert parts is None and cache is None and shifted is inputs
    assert SinksWindow(sinks=0, window=0).empty_cache(1, 2, 4) is None


def test_sinks_need_a_window():
    with pytest.raises(ValueError, match="need a window"):
        SinksWindow(sinks=2, window=0)
    with pytest.raises(ValueError, match="≥ 0"):
        SinksWindow(sinks=0, window=-1)


def test_the_cache_holds_rings_for_the_linear_inputs_and_counts_tokens():
    one_token = (jnp.zeros((3, 1, 2, 4)), jnp.zeros((3, 1, 2, 5)), jnp.zeros((3, 1, 6)))
    cache = SinksWindow(sinks=2, window=7).empty_cache(3, 2, 4, linear_inputs=one_token)
    assert isinstance(cache, SinksWindowCache)
    assert [ring.shape for ring in cache.linear_inputs] == [(3, 7, 2, 4), (3, 7, 2, 5), (3, 7, 6)]
    assert (cache.softmax.sinks, cache.softmax.window, int(cache.length)) == (2, 7, 0)
    assert SinksWindow(sinks=0, window=4).empty_cache(1, 2, 4).linear_inputs is None


def test_with_budget_builds_new_sinks_windows_and_leaves_the_model_as_it_was():
    base = CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gla", window=4, sinks=2), seed=0)
    before = [(b.attn.sinks_window.sinks, b.attn.sinks_window.window) for b in model.layers]
    wider = with_budget(model, sinks=1, window=9)
    assert [(b.attn.sinks_window.sinks, b.attn.sinks_window.window) for b in model.layers] == before
    for old, new in zip(model.layers, wider.layers):
        if not isinstance(new.attn, SoftmaxAttention):
            assert new.attn.sinks_window is not old.attn.sinks_window
            assert (new.attn.sinks_window.sinks, new.attn.sinks_window.window) == (1, 9)


def test_window_only_decoding_keeps_a_sinks_window_cache():
    base = CausalLM(tiny_config("llama", num_hidden_layers=1), rngs=nnx.Rngs(0))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="window", window=3, sinks=1, adapter=None))
    tokens = jnp.arange(6, dtype=jnp.int32)[None] % base.config.vocab_size
    states = model.init_states(1, 6)
    assert isinstance(states[0], SinksWindowCache) and states[0].linear_inputs is None
    logits, states = model(tokens[:, :4], states=states)
    step, states = model(tokens[:, 4:5], states=states)
    assert int(states[0].length) == 5
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(model(tokens[:, :5])[:, 4]), atol=1e-5)
