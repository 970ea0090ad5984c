"""Linearized models: parameter counts, exactness of kept layers, prefill/decode agreement, states, errors."""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.linearize import mixer_names
from linjax.model import CausalLM
from tests.helpers import gated_mechanisms, linear_mechanisms, one_mechanism_per_kernel, relative_rms

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs")
MECHANISMS = linear_mechanisms()
WINDOWS = {"pure": (0, 0), "swa64": (64, 0), "w56s8": (56, 8)}
ADAPTERS = (None, "shortconv", "lora")

# The paper's appendix tables (millions of trainable parameters).
PAPER_COUNTS = [
    ("llama-3.1-8b", "gla", None, 4.33), ("llama-3.1-8b", "kgla", None, 8.52),
    ("llama-3.1-8b", "gdn", None, 8.52), ("llama-3.1-8b", "gla", "shortconv", 6.10),
    ("llama-3.1-8b", "gdn", "shortconv", 10.29), ("llama-3.1-8b", "gla", "lora", 11.15),
    ("llama-3.1-8b", "gdn", "lora", 15.34), ("qwen3-8b", "gla", None, 4.87),
    ("qwen3-8b", "gdn", None, 9.59), ("qwen3-8b", "gdn", "shortconv", 11.58),
    ("qwen3-8b", "gdn", "lora", 17.25),
]


def expected_trainable_count(hf: dict, mechanism: str, adapter: str | None) -> int:
    """The paper's new parameters (appendix), counted from the config's shapes alone."""
    d, heads, kv_heads, layers = (hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"],
                                  hf["num_hidden_layers"])
    head_dim = hf.get("head_dim") or d // heads
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    rank, kernel, lora_rank = 16, 8, 8
    per_layer = d * rank + rank * q_width + q_width  # GLA's gate: W1 [d, 16], W2 [16, H·D], bias [H·D]
    if mechanism in ("gdn", "kgla"):
        per_layer += d * heads + heads  # β: W_β [d, H], bias [H]
    if adapter == "shortconv":  # depthwise kernel 8 with bias on q, k and v
        per_layer += (kernel + 1) * (q_width + 2 * kv_width)
    if adapter == "lora":  # A [in, 8] and B [8, out] on q, k, v and o
        per_layer += lora_rank * ((d + q_width) + 2 * (d + kv_width) + (q_width + d))
    return layers * per_layer


@pytest.mark.parametrize("name,mechanism,adapter,millions", PAPER_COUNTS)
def test_trainable_counts_match_the_paper(name, mechanism, adapter, millions):
    path = os.path.join(FIXTURES, f"{name}.json")
    counts = [linjax.trainable_parameter_count(linjax.abstract_model(
        path, linjax.LinearizeConfig(mechanism=mechanism, adapter=adapter, window=w, sinks=s)))
        for w, s in WINDOWS.values()]
    assert counts[0] == counts[1] == counts[2], "window and sinks must add no parameters"
    with open(path) as f:
        assert counts[0] == expected_trainable_count(json.load(f), mechanism, adapter)
    # The paper's rounded millions, a second check (its GLA + LoRA row prints 11,141,120 as 11.15).
    assert abs(counts[0] / 1e6 - millions) <= 0.005 * millions


def jitted(model):
    """Jitted full forward and stateful forward of an NNX model (split once, merged inside jit)."""
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    stateful = jax.jit(lambda s, t, st: nnx.merge(graphdef, s)(t, states=st))
    return (lambda t: full(state, t)), (lambda t, st: stateful(state, t, st))


@pytest.fixture(scope="module")
def tiny_models():
    return {kind: CausalLM(tiny_config(kind, num_hidden_layers=2), rngs=nnx.Rngs(7)) for kind in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def one_layer_models():
    """One layer is enough for prefill/decode agreement and halves the compile time of the grid."""
    return {kind: CausalLM(tiny_config(kind, num_hidden_layers=1), rngs=nnx.Rngs(7)) for kind in ("llama", "qwen3")}


def tokens_for(model, length, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, model.config.vocab_size, (2, length)), jnp.int32)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("mechanism,window,adapter", list(itertools.product(MECHANISMS, WINDOWS, ADAPTERS)))
def test_prefill_then_decode_equals_one_pass(one_layer_models, kind, mechanism, window, adapter):
    w, s = WINDOWS[window]
    config = linjax.LinearizeConfig(mechanism=mechanism, window=w, sinks=s, adapter=adapter)
    model = linjax.linearize(one_layer_models[kind], config, seed=3)
    if adapter == "lora":  # B starts at zero; make the adapter do something
        for block in model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                b = getattr(block.attn.lora, f"{name}_b")
                b[...] = 0.05 * jax.random.normal(jax.random.key(1), b.shape)
    assert_decode_equals_one_pass(model)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_short_conv_on_the_window_too_decodes_as_one_pass(one_layer_models, kind):
    """conv_on_window: the window softmax reads the convolved q, k, v (decode keeps them in its window cache)."""
    settings = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv", conv_on_window=True)
    model = linjax.linearize(one_layer_models[kind], settings, seed=3)
    assert_decode_equals_one_pass(model)
    usual = linjax.linearize(one_layer_models[kind], dataclasses.replace(settings, conv_on_window=False), seed=3)
    tokens = tokens_for(model, 24)
    assert np.abs(np.asarray(model(tokens)) - np.asarray(usual(tokens))).max() > 1e-3  # the option changes the window


@pytest.mark.parametrize("conv_on_window", [False, True])
def test_an_identity_short_conv_starts_as_the_model_without_one(one_layer_models, conv_on_window):
    """conv_init="identity": the conv passes q, k, v through, on the linear part and (conv_on_window) on the
    window too, so the model starts as it would without the adapter; PyTorch's init does not."""
    settings = linjax.LinearizeConfig(mechanism="gdn", window=8, sinks=2, adapter="shortconv", conv_init="identity",
                                      conv_on_window=conv_on_window)
    without = dataclasses.replace(settings, adapter=None, conv_on_window=False)
    base = one_layer_models["llama"]
    model, plain = (linjax.linearize(base, s, seed=3) for s in (settings, without))
    tokens = tokens_for(model, 24)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(plain(tokens)), atol=1e-5)
    torch_init = linjax.linearize(base, dataclasses.replace(settings, conv_init="torch"), seed=3)
    assert np.abs(np.asarray(torch_init(tokens)) - np.asarray(plain(tokens))).max() > 1e-3
    with pytest.raises(ValueError, match="unknown conv_init 'zeros'"):
        dataclasses.replace(settings, conv_init="zeros")


def assert_decode_equals_one_pass(model):
    """Prefill, decode and further prefills with the decode states give the logits of one full pass."""
    full, stateful = jitted(model)
    # A 40-token prompt (shorter than the window), 30 decode steps across the window's edge, then the
    # rest of a 150-token sequence as two more 40-token prefills (splits at 70 and 110, not chunk
    # multiples). Equal piece lengths keep the number of compilations down.
    T, piece, decoded = 150, 40, 30
    tokens = tokens_for(model, T)
    expected = np.asarray(full(tokens))
    assert np.isfinite(expected).all()
    states = model.init_states(2, T)
    pieces = []
    logits, states = stateful(tokens[:, :piece], states)
    pieces.append(logits)
    for i in range(piece, piece + decoded):
        logits, states = stateful(tokens[:, i:i + 1], states)
        pieces.append(logits)
    for start in range(piece + decoded, T, piece):
        logits, states = stateful(tokens[:, start:start + piece], states)
        pieces.append(logits)
    got = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    assert relative_rms(got, expected) <= 1e-5


def randomise_output_gain(model, seed=5):
    """Moves every linear mixer's output gain off its initial 1 (different per head and layer, in
    [0.5, 1.5]: positive, as Hedgehog's shared normaliser needs)."""
    for i, block in enumerate(model.layers):
        gain = getattr(block.attn, "output_gain", None)  # kept softmax layers have none
        if gain is not None:
            gain[...] = jax.random.uniform(jax.random.key(seed + i), gain.shape, minval=0.5, maxval=1.5)


@pytest.mark.parametrize("mechanism,window,combine", [
    ("gdn", "w56s8", "sum"), ("gla", "pure", "sum"),
    ("hedgehog", "pure", "sum"), ("hedgehog", "w56s8", "sum"), ("hedgehog", "w56s8", "mixed"),
])
def test_scale_and_output_gain_decode_equals_one_pass(one_layer_models, mechanism, window, combine):
    """A set scale (0.5: neither mechanism's default) and learned gains away from 1, decoded step by step."""
    w, s = WINDOWS[window]
    config = linjax.LinearizeConfig(mechanism=mechanism, window=w, sinks=s, combine=combine, scale=0.5,
                                    output_gain=True, adapter="shortconv")
    model = linjax.linearize(one_layer_models["qwen3"], config, seed=3)
    randomise_output_gain(model)
    assert_decode_equals_one_pass(model)


def test_output_gain_init_sets_the_gains_start(one_layer_models):
    """output_gain_init: every head's gain starts there (LoLCATs' window factor 0.1 is a gain of 10);
    it must be > 0 and finite, and it needs output_gain."""
    config = linjax.LinearizeConfig(mechanism="hedgehog", window=8, sinks=0, output_gain=True, output_gain_init=10)
    model = linjax.linearize(one_layer_models["qwen3"], config, seed=3)
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.output_gain[...]), 10.0)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="output_gain_init must be a finite number > 0"):
            linjax.LinearizeConfig(output_gain=True, output_gain_init=bad)
    with pytest.raises(ValueError, match="needs output_gain=true"):
        linjax.LinearizeConfig(output_gain_init=10.0)


def test_scale_and_output_gain_act_on_the_linear_term(one_layer_models):
    """Without a window, y = g_h · scale · qᵀS: a gain of c on every head is the scale times c, and
    a scale other than the default (1, the paper's) changes the output; "fla_default" is the
    kernels' Dk^-1/2. The gain adds one parameter per head and layer."""
    base = one_layer_models["llama"]
    tokens = tokens_for(base, 24, seed=2)
    run = lambda model: np.asarray(jitted(model)[0](tokens))
    make = lambda **kw: linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0, **kw),
                                         seed=1)
    head_dim = base.config.head_dim
    default, half = make(), make(scale=0.5)
    assert default.linearize_config.scale == 1.0
    assert relative_rms(run(make(scale=1)), run(default)) == 0.0
    fla = make(scale="fla_default")
    assert fla.linearize_config.scale is None
    assert relative_rms(run(make(scale=head_dim ** -0.5)), run(fla)) == 0.0  # the kernels' own Dk^-1/2
    assert relative_rms(run(half), run(default)) > 1e-3
    gained = make(scale=0.25, output_gain=True)
    for block in gained.layers:
        block.attn.output_gain[...] = jnp.full(block.attn.output_gain.shape, 2.0)
    assert relative_rms(run(gained), run(half)) <= 1e-6
    config = base.config
    assert (linjax.trainable_parameter_count(gained) - linjax.trainable_parameter_count(default)
            == config.num_hidden_layers * config.num_attention_heads)


def test_keeping_every_layer_is_bitwise_the_original(tiny_models):
    base = tiny_models["qwen3"]
    config = linjax.LinearizeConfig(mechanism="gdn", keep_full_attention=(0, 1))
    model = linjax.linearize(base, config)
    tokens = tokens_for(base, 33)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(base(tokens)))
    assert linjax.linearize(base, linjax.LinearizeConfig(keep_full_attention=1.0)).layers[0].attn.__class__.__name__ \
        == "SoftmaxAttention"


def test_a_window_covering_the_sequence_is_the_original_attention(tiny_models):
    # With w ≥ T nothing reaches the linear state, so the output is exact softmax attention.
    base = tiny_models["llama"]
    tokens = tokens_for(base, 40, seed=5)
    for mechanism in MECHANISMS:
        model = linjax.linearize(base, linjax.LinearizeConfig(mechanism=mechanism, window=40, sinks=0,
                                                              adapter="shortconv"))
        assert relative_rms(np.asarray(jitted(model)[0](tokens)), np.asarray(base(tokens))) <= 1e-5, mechanism


def test_pretrained_weights_are_shared_not_copied(tiny_models):
    base = tiny_models["llama"]
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gla", adapter="lora"))
    assert model.layers[0].attn.proj.q_proj.kernel[...] is base.layers[0].attn.proj.q_proj.kernel[...]
    assert base.linearize_config is None and type(base.layers[0].attn).__name__ == "SoftmaxAttention"
    frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(linjax.layers.Trainable)))
    assert linjax.parameter_count(base) == sum(x.size for x in jax.tree.leaves(frozen))


def test_hybrid_layers_fraction_and_indices():
    config = linjax.LinearizeConfig(mechanism="gdn", keep_full_attention=0.2)
    assert config.full_attention_layers(30) == (2, 7, 12, 17, 22, 27)  # 6 = 0.2 · 30, slice centres
    assert linjax.LinearizeConfig(keep_full_attention=[0, -1]).full_attention_layers(4) == (0, 3)
    from linjax.linearize import mixer_names

    model = linjax.linearize(CausalLM(tiny_config("llama", num_hidden_layers=4), rngs=nnx.Rngs(0)),
                             linjax.LinearizeConfig(mechanism="gla", keep_full_attention=(1,)))
    assert mixer_names(model) == ["gla", "softmax", "gla", "gla"]
    full, stateful = jitted(model)
    tokens = tokens_for(model, 70)
    states = model.init_states(2, 70)
    first, states = stateful(tokens[:, :61], states)
    second, states = stateful(tokens[:, 61:62], states)
    third, _ = stateful(tokens[:, 62:], states)
    got = np.concatenate([np.asarray(x) for x in (first, second, third)], axis=1)
    assert relative_rms(got, np.asarray(full(tokens))) <= 1e-5


def test_linear_decode_states_do_not_grow_with_context(tiny_models):
    config = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv",
                                    keep_full_attention=(1,))
    model = linjax.linearize(tiny_models["qwen3"], config)
    short, long = model.init_states(1, 128), model.init_states(1, 65536)
    shapes = lambda s: [x.shape for x in jax.tree.leaves(s)]
    assert shapes(short[0]) == shapes(long[0])  # the linear layer
    assert shapes(short[1]) != shapes(long[1])  # the full-attention layer's KV cache grows


@pytest.mark.parametrize("settings,match", [
    (dict(window=-1), "window and sinks must be ≥ 0"),
    (dict(sinks=-2), "window and sinks must be ≥ 0"),
    (dict(window=0, sinks=4), "need a window"),
    (dict(mechanism="mamba"), "unknown mechanism 'mamba'"),
    (dict(adapter="dora"), "unknown adapter 'dora'"),
    (dict(combine="avg"), "unknown combine"),
    (dict(keep_full_attention=1.5), "fraction must be in"),
    (dict(mechanism="window", window=0, sinks=0), "needs window ≥ 1"),
    (dict(mechanism="window", adapter="shortconv"), "no linear part"),
    (dict(scale=0), "scale must be a finite number > 0"),
    (dict(scale=-1.0), "scale must be a finite number > 0"),
    (dict(scale=float("inf")), "scale must be a finite number > 0"),
    (dict(scale="1"), "scale must be a finite number > 0"),
    (dict(output_gain="yes"), "output_gain must be true or false"),
    (dict(conv_on_window=True), "needs the short conv"),
    (dict(conv_on_window=True, adapter="shortconv", window=0, sinks=0),
     r"and window ≥ 1 \(got adapter='shortconv', window=0\)"),
    (dict(conv_on_window="yes", adapter="shortconv"), "conv_on_window must be true or false"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        linjax.LinearizeConfig(**settings)


def test_layer_index_out_of_range_is_refused(tiny_models):
    with pytest.raises(ValueError, match=r"layer indices \[5\] out of range for a 2-layer model"):
        linjax.linearize(tiny_models["llama"], linjax.LinearizeConfig(keep_full_attention=(0, 5)))


def test_linearized_checkpoint_round_trip(tiny_models, tmp_path):
    from linjax.convert.checkpoint import load_checkpoint, save_checkpoint

    config = linjax.LinearizeConfig(mechanism="hedgehog", window=8, sinks=2, adapter="lora",
                                    keep_full_attention=(0,), scale=0.5, output_gain=True)
    model = linjax.linearize(tiny_models["qwen3"], config, seed=4)
    randomise_output_gain(model)
    save_checkpoint(model, str(tmp_path / "ckpt"))
    restored, _ = load_checkpoint(str(tmp_path / "ckpt"))
    assert restored.linearize_config == config
    tokens = tokens_for(model, 20)
    np.testing.assert_array_equal(np.asarray(jitted(restored)[0](tokens)), np.asarray(jitted(model)[0](tokens)))


def test_a_checkpoint_saved_before_the_scale_default_moved_loads_at_dk_to_the_minus_half(tiny_models, tmp_path):
    """The default scale moved from FLA's Dk^-1/2 (stored as null) to 1. A checkpoint that stored null, or
    that was written before linjax had the setting, must load as it was trained; a new one stores 1."""
    from linjax.convert.checkpoint import MANIFEST, load_checkpoint, save_checkpoint

    base = tiny_models["llama"]
    old = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0, scale="fla_default"),
                           seed=2)
    tokens = tokens_for(base, 20)
    want = np.asarray(jitted(old)[0](tokens))
    for stored in ("null", "absent"):
        path = str(tmp_path / stored)
        save_checkpoint(old, path)
        manifest_path = os.path.join(path, MANIFEST)
        with open(manifest_path) as f:
            manifest = json.load(f)
        assert manifest["linearize"]["scale"] is None
        if stored == "absent":  # as written before the setting (and before linjax recorded its files' hashes)
            del manifest["linearize"]["scale"]
            with open(manifest_path, "w") as f:
                json.dump(manifest, f)
            os.remove(os.path.join(path, ".linjax-export"))
        restored, _ = load_checkpoint(path)
        assert restored.linearize_config.scale is None
        np.testing.assert_array_equal(np.asarray(jitted(restored)[0](tokens)), want)
    new = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0), seed=2)
    save_checkpoint(new, str(tmp_path / "new"))
    with open(os.path.join(tmp_path, "new", MANIFEST)) as f:
        assert json.load(f)["linearize"]["scale"] == 1.0


def test_linearized_generate_is_greedy_under_one_full_pass(tiny_models):
    model = linjax.linearize(tiny_models["llama"], linjax.LinearizeConfig(mechanism="gdn", window=4, sinks=1))
    prompt = tokens_for(model, 6, seed=9)
    out = np.asarray(linjax.generate(model, prompt, 8))
    np.testing.assert_array_equal(out[:, :6], np.asarray(prompt))
    # Each generated token is the argmax of a full (stateless) forward over everything before it.
    full, _ = jitted(model)
    predicted = np.asarray(full(jnp.asarray(out))).argmax(-1)
    np.testing.assert_array_equal(out[:, 6:], predicted[:, 5:-1])


@pytest.mark.parametrize("mechanism", one_mechanism_per_kernel())
def test_jitted_equals_eager_at_head_dim_64(mechanism):
    # jaxlib 0.10's CPU "ynn" fusion can turn jitted chunked kernels into garbage at head dim 64
    # (tests/kernels/test_cpu_miscompile.py); eager execution never fuses, so it is the witness.
    base = CausalLM(tiny_config("llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=64, hidden_size=128), rngs=nnx.Rngs(2))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism=mechanism, window=0, sinks=0))
    tokens = tokens_for(model, 70, seed=4)
    assert relative_rms(np.asarray(jitted(model)[0](tokens)), np.asarray(model(tokens))) <= 1e-5


@pytest.mark.parametrize("mechanism,extra", [(m, {}) for m in one_mechanism_per_kernel()] +
                         [("gdn", dict(scale=1.0, output_gain=True))])
def test_pallas_kernels_inside_the_model_match_chunked(tiny_models, mechanism, extra):
    base = tiny_models["qwen3"]
    settings = dict(mechanism=mechanism, window=8, sinks=2, adapter="shortconv", **extra)
    chunked = linjax.linearize(base, linjax.LinearizeConfig(**settings, kernel="chunked"), seed=1)
    pallas = linjax.linearize(base, linjax.LinearizeConfig(**settings, kernel="pallas"), seed=1)
    if extra.get("output_gain"):
        randomise_output_gain(chunked), randomise_output_gain(pallas)
    tokens = tokens_for(base, 40, seed=6)
    assert relative_rms(np.asarray(jitted(pallas)[0](tokens)), np.asarray(jitted(chunked)[0](tokens))) <= 1e-5
    # Both parts of the block run as Pallas kernels: the linear one and the sinks + window softmax.
    program = str(jax.make_jaxpr(lambda t: pallas(t))(tokens))
    assert "linjax_swa_sinks_fwd" in program and "linjax_chunk_states_fwd" in program


# ----------------------------------------------------------------------------- window-only baseline


def _dense_window_attention(base, tokens, sinks, window):
    """Block 0's attention output with the sink + window mask applied to dense softmax scores (numpy)."""
    proj = base.layers[0].attn.proj
    h = base.layers[0].input_layernorm(base.embed_tokens(tokens))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    q, k, v = (np.asarray(x, np.float64) for x in proj.qkv(h, positions))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bthd,bjhd->bhtj", q, k) / np.sqrt(q.shape[-1])
    t, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
    allowed = (j <= t) & ((j < sinks) | (t - j < window))
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("bhtj,bjhd->bthd", p / p.sum(-1, keepdims=True), v)
    return np.asarray(proj.out(jnp.asarray(o, jnp.float32)))


def test_window_only_is_dense_masked_softmax_and_adds_no_parameters(tiny_models):
    base = tiny_models["qwen3"]
    tokens = tokens_for(base, 50, seed=2)
    for sinks, window in ((3, 10), (0, 7)):
        model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="window", window=window, sinks=sinks))
        assert linjax.trainable_parameter_count(model) == 0
        assert mixer_names(model) == ["window", "window"]
        block = model.layers[0]
        h = block.input_layernorm(base.embed_tokens(tokens))
        positions = jnp.broadcast_to(jnp.arange(50), tokens.shape)
        got = np.asarray(block.attn(h, positions))
        assert relative_rms(got, _dense_window_attention(base, tokens, sinks, window)) <= 1e-5
    # A window covering the sequence is the original model.
    wide = linjax.linearize(base, linjax.LinearizeConfig(mechanism="window", window=50, sinks=0))
    assert relative_rms(np.asarray(wide(tokens)), np.asarray(base(tokens))) <= 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_window_only_prefill_then_decode_equals_one_pass(one_layer_models, kind):
    model = linjax.linearize(one_layer_models[kind], linjax.LinearizeConfig(mechanism="window", window=12, sinks=3))
    full, stateful = jitted(model)
    tokens = tokens_for(model, 60, seed=4)
    expected = np.asarray(full(tokens))
    states = model.init_states(2, 60)
    pieces = []
    logits, states = stateful(tokens[:, :20], states)  # prefill past the window
    pieces.append(logits)
    for i in range(20, 40):  # decode across the ring's wrap
        logits, states = stateful(tokens[:, i:i + 1], states)
        pieces.append(logits)
    logits, states = stateful(tokens[:, 40:], states)  # a second prefill after decoding
    pieces.append(logits)
    assert relative_rms(np.concatenate([np.asarray(p) for p in pieces], axis=1), expected) <= 1e-5
    assert [x.shape for x in jax.tree.leaves(model.init_states(2, 10))] == \
        [x.shape for x in jax.tree.leaves(model.init_states(2, 10_000))]  # the cache is the budget, not the context


@pytest.mark.parametrize("mechanism", gated_mechanisms())
def test_gate_bias_sets_the_initial_decay(one_layer_models, mechanism):
    base = one_layer_models["llama"]
    biases = {}
    for gate_bias in (1.0, 3.0):
        model = linjax.linearize(base, linjax.LinearizeConfig(mechanism=mechanism, window=0, sinks=0,
                                                              gate_bias=gate_bias))
        mixer = model.layers[0].attn
        gate = mixer.gate.bias if mechanism != "gdn_scalar" else mixer.gate_bias
        biases[gate_bias] = np.asarray(gate[...])
        np.testing.assert_array_equal(biases[gate_bias], np.full(biases[gate_bias].shape, gate_bias, np.float32))
    # α = sigmoid(bias) with the low-rank term near zero at init: 0.73 (about 4 tokens) vs 0.95.
    assert np.allclose(1 / (1 + np.exp(-biases[1.0])), 0.731, atol=1e-3)
    with pytest.raises(ValueError, match="gate_bias must be a finite number"):
        linjax.LinearizeConfig(mechanism=mechanism, gate_bias=float("nan"))
