"""Liger-GLA (a peer method the claims compare against): GLA whose decay gate is read from the frozen key projection.

`LinearizeConfig(mechanism="gla", gate="liger_pooled_key")`: log α = LogSigmoid(pool(k_proj(h))) / 16,
no gate parameters; with `feature_map="softmax"`, `linear_rope=False`, `state_covers_window=True` and
`lora_targets=["q", "k", "v"]`, the form Liger's code runs. Here: the gate's formula, that form against a
direct computation of Liger's, decode == one pass, the parameter count, the default gate left as it was,
a checkpoint round trip, the claims configs, and the PyTorch export's logits.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.model import CausalLM
from tests.helpers import linear_mechanisms, relative_rms
from tests.test_linearize import assert_decode_equals_one_pass, jitted, tokens_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIGER = dict(mechanism="gla", gate="liger_pooled_key", combine="mixed", window=64, sinks=0, adapter="lora",
             lora_alpha=8.0)
# As Liger's code: softmax feature maps on q and k before RoPE, GLA over every token, LoRA on q, k and v.
LIGER_CODE = dict(LIGER, feature_map="softmax", linear_rope=False, state_covers_window=True,
                  lora_targets=["q", "k", "v"])


def liger_model(kind="llama", layers=1, seed=3, **overrides):
    """A tiny model linearized as Liger-GLA, LoRA's B moved off zero so the adapted key feeds the gate."""
    config = tiny_config(kind, num_hidden_layers=layers, attention_bias=kind == "llama")
    model = linjax.linearize(CausalLM(config, rngs=nnx.Rngs(7)), linjax.LinearizeConfig(**{**LIGER, **overrides}),
                             seed=seed)
    for i, block in enumerate(model.layers):
        for name in block.attn.lora.targets:
            b = getattr(block.attn.lora, f"{name}_b")
            b[...] = 0.05 * jax.random.normal(jax.random.key(10 * i + len(name)), b.shape)
    return model


def test_the_gate_is_the_adapted_key_projection_through_logsigmoid_over_16():
    model = liger_model()
    mixer = model.layers[0].attn
    h = jax.random.normal(jax.random.key(0), (2, 5, model.config.hidden_size))
    (log_alpha,) = mixer.gates(h, None)
    proj = mixer.proj
    key = np.asarray(proj.k_proj(h) + mixer.lora.delta("k_proj", h))  # before q/k norm and RoPE
    heads, kv_heads, head_dim = proj.num_heads, proj.num_kv_heads, proj.head_dim
    key = key.reshape(2, 5, kv_heads, head_dim).repeat(heads // kv_heads, axis=2)  # query head h reads h // groups
    expected = np.asarray(jax.nn.log_sigmoid(jnp.asarray(key, jnp.float32))) / 16
    assert log_alpha.shape == (2, 5, heads, head_dim) and log_alpha.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(log_alpha), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind,window,sinks", [("llama", 64, 0), ("qwen3", 56, 8), ("llama", 0, 0)])
def test_prefill_then_decode_equals_one_pass(kind, window, sinks):
    combine = "mixed" if window else "sum"
    assert_decode_equals_one_pass(liger_model(kind, window=window, sinks=sinks, combine=combine))


@pytest.mark.parametrize("kind,window,sinks", [("llama", 64, 0), ("llama", 56, 8), ("qwen3", 24, 0)])
def test_the_code_form_decodes_as_one_pass(kind, window, sinks):
    assert_decode_equals_one_pass(liger_model(kind, window=window, sinks=sinks, **{
        k: v for k, v in LIGER_CODE.items() if k not in ("window", "sinks")}))


def liger_code_reference(mixer, x, window):
    """Liger's attention as its code computes it (liger_gla modeling), in NumPy, one token at a time: GLA on
    softmax(q), softmax(k) of the projections (no RoPE) over every token with log α = LogSigmoid(k) / 16
    and scale 1, beside softmax attention over the last `window` tokens with RoPE; 0.5 of each, then o_proj."""
    from linjax.layers import apply_rope, rope_inverse_frequencies

    proj, lora = mixer.proj, mixer.lora
    b, t, _ = x.shape
    heads, kv_heads, d = proj.num_heads, proj.num_kv_heads, proj.head_dim
    project = lambda name, n: np.asarray(proj._project(name, x, lora)).reshape(b, t, n, d).astype(np.float64)
    q, k, v = project("q_proj", heads), project("k_proj", kv_heads), project("v_proj", kv_heads)
    if proj.q_norm is not None:  # Qwen3: linjax's linear part reads q and k after its norms (only RoPE undone)
        q, k = (np.asarray(norm(jnp.asarray(a, jnp.float32)), np.float64) for norm, a in
                ((proj.q_norm, q), (proj.k_norm, k)))
    log_alpha = np.asarray(jax.nn.log_sigmoid(jnp.asarray(project("k_proj", kv_heads)))) / 16
    group = heads // kv_heads
    k, v, log_alpha = (np.repeat(a, group, axis=2) for a in (k, v, log_alpha))

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    fq, fk = softmax(q), softmax(k)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    inv_freq = rope_inverse_frequencies(proj.config)
    rq, rk = (np.asarray(apply_rope(jnp.asarray(a, jnp.float32), positions, inv_freq), np.float64) for a in (q, k))
    out = np.zeros((b, t, heads, d))
    state = np.zeros((b, heads, d, d))
    for i in range(t):
        state = np.exp(log_alpha[:, i])[..., None] * state + fk[:, i, :, :, None] * v[:, i, :, None, :]
        linear = np.einsum("bhd,bhde->bhe", fq[:, i], state)
        first = max(0, i - window + 1)
        scores = np.einsum("bhd,bshd->bhs", rq[:, i], rk[:, first:i + 1]) / np.sqrt(d)
        weights = softmax(scores)
        windowed = np.einsum("bhs,bshd->bhd", weights, v[:, first:i + 1])
        out[:, i] = 0.5 * linear + 0.5 * windowed
    return np.asarray(proj.out(jnp.asarray(out, jnp.float32), lora))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_code_form_is_liger_codes_computation(kind):
    model = liger_model(kind, window=8, **{k: v for k, v in LIGER_CODE.items() if k != "window"})
    mixer = model.layers[0].attn
    x = jax.random.normal(jax.random.key(1), (2, 21, model.config.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(21), (2, 21))
    got = np.asarray(mixer(x, positions))
    assert relative_rms(got, liger_code_reference(mixer, x, window=8)) <= 1e-5
    # each of the three settings changes the output: they are not the defaults in disguise
    for setting, default in (("feature_map", "l2"), ("linear_rope", True), ("state_covers_window", False)):
        other = liger_model(kind, window=8, **{**{k: v for k, v in LIGER_CODE.items() if k != "window"},
                                               setting: default})
        assert relative_rms(np.asarray(other.layers[0].attn(x, positions)), got) > 1e-3, setting


def test_lora_adapts_only_its_targets():
    liger, every = liger_model(layers=2, lora_targets=["q", "k", "v"]), liger_model(layers=2)
    mixer = liger.layers[0].attn
    assert mixer.lora.targets == ("q_proj", "k_proj", "v_proj") and not hasattr(mixer.lora, "o_proj_a")
    o_proj = every.layers[0].attn.proj.o_proj.kernel
    rank = liger.linearize_config.lora_rank
    assert (linjax.trainable_parameter_count(every) - linjax.trainable_parameter_count(liger)
            == 2 * rank * (o_proj.shape[0] + o_proj.shape[1]))
    h = jax.random.normal(jax.random.key(2), (1, 3, o_proj.shape[0]))
    assert float(jnp.abs(mixer.lora.delta("o_proj", h)).max()) == 0.0


@pytest.mark.parametrize("settings, message", [
    (dict(mechanism="gdn", feature_map="softmax"), "feature_map='softmax' is a GLA feature map"),
    (dict(mechanism="gla", feature_map="elu"), "unknown feature_map 'elu'"),
    (dict(mechanism="gla", linear_rope=False, adapter="shortconv"), "linear_rope=false takes the linear part"),
    (dict(mechanism="gla", state_covers_window=True, window=0, sinks=0), "state_covers_window=true puts"),
    (dict(mechanism="gla", state_covers_window=True, retain=8), "does not combine with"),
    (dict(mechanism="window", linear_rope=False), "mechanism='window' has none"),
    (dict(mechanism="gla", adapter="lora", lora_targets=["q", "x"]), "lora_targets must be a list of distinct"),
    (dict(mechanism="gla", lora_targets=["q"]), "it needs adapter='lora'"),
    (dict(mechanism="gla", linear_rope="no"), "linear_rope must be true or false")])
def test_the_code_forms_settings_refuse_what_they_cannot_mean_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        linjax.LinearizeConfig(**settings)
    assert "\n" not in str(error.value)


def test_settings_saved_before_the_code_form_load_as_they_were():
    saved = linjax.LinearizeConfig(**LIGER).to_dict()
    for key in ("feature_map", "linear_rope", "state_covers_window", "lora_targets"):
        del saved[key]
    restored = linjax.LinearizeConfig.from_saved(saved)
    assert (restored.feature_map, restored.linear_rope, restored.state_covers_window, restored.lora_targets) == (
        "l2", True, False, ("q", "k", "v", "o"))


def test_pallas_kernels_inside_the_model_match_chunked():
    """The Pallas GLA kernel takes the pooled-key log α as it takes the low-rank one (interpreted on CPU)."""
    chunked = liger_model("qwen3", window=8, kernel="chunked")
    pallas = liger_model("qwen3", window=8, kernel="pallas")
    tokens = tokens_for(chunked, 40, seed=6)
    assert relative_rms(np.asarray(jitted(pallas)[0](tokens)), np.asarray(jitted(chunked)[0](tokens))) <= 1e-5
    assert "linjax_chunk_states_fwd" in str(jax.make_jaxpr(lambda t: pallas(t))(tokens))


def test_the_gate_has_no_parameters():
    """The count drops by the low-rank gate's W1 [d, 16], W2 [16, H·D] and bias [H·D], per layer."""
    liger = liger_model(layers=2)
    low_rank = liger_model(layers=2, gate="low_rank")
    config = liger.config
    d, width = config.hidden_size, config.num_attention_heads * config.head_dim
    gate_size = d * 16 + 16 * width + width
    assert (linjax.trainable_parameter_count(low_rank) - linjax.trainable_parameter_count(liger)
            == config.num_hidden_layers * gate_size)
    assert all("gate" not in jax.tree_util.keystr(path)
               for path, _ in jax.tree_util.tree_flatten_with_path(nnx.state(liger, linjax.layers.Trainable))[0])


def test_the_default_gate_is_the_low_rank_one_and_other_mechanisms_refuse_the_option():
    assert linjax.LinearizeConfig().gate == "low_rank"
    base = CausalLM(tiny_config("llama", num_hidden_layers=1), rngs=nnx.Rngs(7))
    tokens = tokens_for(base, 24)
    run = lambda **kw: np.asarray(jitted(linjax.linearize(  # no window: every token reaches the linear state
        base, linjax.LinearizeConfig(mechanism="gla", window=0, sinks=0, **kw), seed=1))[0](tokens))
    np.testing.assert_array_equal(run(gate="low_rank"), run())
    assert relative_rms(run(gate="liger_pooled_key"), run()) > 1e-3
    # A config saved before the option existed (no "gate") loads with the low-rank gate.
    saved = linjax.LinearizeConfig(mechanism="gla").to_dict()
    del saved["gate"]
    assert linjax.LinearizeConfig.from_saved(saved).gate == "low_rank"
    for mechanism in (m for m in linear_mechanisms() if m != "gla"):
        with pytest.raises(ValueError, match="gate='liger_pooled_key' is a GLA gate"):
            linjax.LinearizeConfig(mechanism=mechanism, gate="liger_pooled_key")
    with pytest.raises(ValueError, match="unknown gate 'pooled'"):
        linjax.LinearizeConfig(mechanism="gla", gate="pooled")


def test_a_checkpoint_with_the_gate_reloads_with_it(tmp_path):
    from linjax.convert.checkpoint import load_checkpoint, save_checkpoint

    model = liger_model(kind="qwen3", layers=2)
    save_checkpoint(model, str(tmp_path / "ckpt"))
    restored, _ = load_checkpoint(str(tmp_path / "ckpt"))
    assert restored.linearize_config == model.linearize_config
    assert restored.linearize_config.gate == "liger_pooled_key"
    tokens = tokens_for(model, 20)
    np.testing.assert_array_equal(np.asarray(jitted(restored)[0](tokens)), np.asarray(jitted(model)[0](tokens)))


def test_the_claims_config_is_the_peer_recipe():
    from linjax.experiment import load_experiment

    config = load_experiment(os.path.join(ROOT, "configs", "claims", "liger-gla.toml"))
    settings = config.linearize
    assert (settings.mechanism, settings.gate, settings.combine) == ("gla", "liger_pooled_key", "mixed")
    assert (settings.window, settings.sinks, settings.adapter, settings.lora_rank) == (64, 0, "lora", 8)
    assert (config.model.source, config.train.steps, config.train.seq_len) == ("smollm2-135m", 2000, 512)
    row = load_experiment(os.path.join(ROOT, "configs", "claims", "gla-w56-s8.toml"))  # the same data and budget
    assert config.data == row.data
    assert (config.train.batch_size, config.train.warmup_steps, config.train.objective) == (
        row.train.batch_size, row.train.warmup_steps, row.train.objective)


def test_the_code_claims_config_is_liger_codes_recipe():
    """configs/claims/liger-gla-code.toml: the form and the training Liger's code uses, on the claims rows'
    data and budget; its seeds and its sinks variant differ from it where named only."""
    from linjax.experiment import load_experiment

    config = load_experiment(os.path.join(ROOT, "configs", "claims", "liger-gla-code.toml"))
    expected = linjax.LinearizeConfig(**{**LIGER_CODE, "lora_rank": 8, "scale": 1.0})
    assert config.linearize == expected
    train = config.train
    assert (train.lr, train.warmup_steps, train.weight_decay, train.grad_clip) == (1e-3, 0, 0.01, 0)
    assert (train.schedule, train.keep, train.validation_records, train.validate_every) == (
        "plateau", "best_validation", 200, 200)
    assert train.validation.endswith("alpaca/alpaca_data_cleaned_first5k.json")
    row = load_experiment(os.path.join(ROOT, "configs", "claims", "gla-w56-s8.toml"))  # the same data and budget
    assert config.data == row.data and (train.steps, train.seq_len, train.batch_size) == (2000, 512, 1)
    for seed in (2, 3):
        other = load_experiment(os.path.join(ROOT, "configs", "claims", f"liger-gla-code-seed{seed}.toml"))
        assert other.train.seed == seed and other.linearize == config.linearize
        assert dataclasses.replace(other.train, seed=1) == train
    sinks = load_experiment(os.path.join(ROOT, "configs", "claims", "liger-gla-code-w56-s8.toml"))
    assert sinks.linearize == dataclasses.replace(config.linearize, window=56, sinks=8) and sinks.train == train


def write_liger_cases(root: str):
    """JAX side (run in a subprocess): export Liger-GLA models (LLaMA with biases, Qwen3) with tokens,
    logits and a greedy continuation."""
    jax.config.update("jax_disable_most_optimizations", True)
    tokens = np.random.default_rng(0).integers(0, 128, (2, 150)).astype(np.int32)
    manifest = []
    code = {k: v for k, v in LIGER_CODE.items() if k not in ("window", "sinks")}
    for name, model in (("liger-llama", liger_model("llama", layers=2)),
                        ("liger-qwen3", liger_model("qwen3", layers=2, window=56, sinks=8)),
                        ("liger-code-llama", liger_model("llama", layers=2, **code)),
                        ("liger-code-qwen3", liger_model("qwen3", layers=2, window=56, sinks=8, **code))):
        linjax.save_hf(model, os.path.join(root, name))
        np.savez(os.path.join(root, name + ".npz"), tokens=tokens,
                 logits=np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))))
        manifest.append({"name": name, "kind": "linjax", "recurrent": True})
        prompt = tokens[:1, :70]  # past the window: decoding crosses into the linear state
        np.savez(os.path.join(root, name + ".generate.npz"), prompt=prompt,
                 generated=np.asarray(linjax.generate(model, jnp.asarray(prompt), 20)))
        manifest.append({"name": name, "kind": "generate"})
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_export_matches_linjax_without_jax(tmp_path):
    from tests.test_export import TOLERANCE, TORCH_CHECK, _run

    root = str(tmp_path)
    _run(["-c", f"from tests.test_liger_gla import write_liger_cases; write_liger_cases({root!r})"], cwd=root)
    results = json.loads(_run(["-c", TORCH_CHECK, root], cwd=root).strip().splitlines()[-1])
    print(json.dumps(results, indent=1))
    for name in ("liger-llama", "liger-qwen3", "liger-code-llama", "liger-code-qwen3"):
        for case in (name, name + "-recurrent"):
            assert results[case]["max_abs"] <= TOLERANCE, f"{case}: max abs logit difference {results[case]}"
            assert results[case]["class"] == "LinjaxForCausalLM"
        for cache in (0, 1):
            assert results[f"{name}-generate-cache{cache}"]["match"], f"{name}: greedy generation differs"


def test_a_trained_run_with_the_gate_reloads_with_it_and_resumes_only_with_it(tiny_source, tmp_path):
    from linjax import train
    from linjax.experiment import from_dict

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Document {i}: " + " word" * (20 + 9 * i)}) for i in range(8)))
    raw = {"run_dir": str(tmp_path / "run"), "model": {"source": tiny_source},
           "linearize": {**LIGER, "window": 8}, "data": {"paths": [str(corpus)]},
           "train": dict(steps=2, seq_len=32, batch_size=2, warmup_steps=1, checkpoint_every=1, seed=3)}
    trained = train.run(from_dict(raw), progress=False)
    restored, _ = linjax.load(str(tmp_path / "run"))
    assert restored.linearize_config.gate == "liger_pooled_key"
    assert restored.linearize_config == trained.linearize_config
    for a, b in zip(jax.tree.leaves(nnx.state(restored)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = {**raw, "linearize": {**raw["linearize"], "gate": "low_rank"}, "train": {**raw["train"], "steps": 3}}
    with pytest.raises(ValueError, match="linearize.gate 'liger_pooled_key' → 'low_rank'"):
        train.run(from_dict(other), resume=True, progress=False)
