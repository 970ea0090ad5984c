"""Liger-GLA (a peer method the claims compare against): GLA whose decay gate is read from the frozen key projection.

`LinearizeConfig(mechanism="gla", gate="liger_pooled_key")`: log α = LogSigmoid(pool(k_proj(h))) / 16,
no gate parameters. Here: the gate's formula, decode == one pass, the parameter count, the default
gate left as it was, a checkpoint round trip, the claims config, and the PyTorch export's logits.
"""

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


def liger_model(kind="llama", layers=1, seed=3, **overrides):
    """A tiny model linearized as Liger-GLA, LoRA's B moved off zero so the adapted key feeds the gate."""
    config = tiny_config(kind, num_hidden_layers=layers, attention_bias=kind == "llama")
    model = linjax.linearize(CausalLM(config, rngs=nnx.Rngs(7)), linjax.LinearizeConfig(**{**LIGER, **overrides}),
                             seed=seed)
    for i, block in enumerate(model.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
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


def write_liger_cases(root: str):
    """JAX side (run in a subprocess): export Liger-GLA models (LLaMA with biases, Qwen3) with tokens,
    logits and a greedy continuation."""
    jax.config.update("jax_disable_most_optimizations", True)
    tokens = np.random.default_rng(0).integers(0, 128, (2, 150)).astype(np.int32)
    manifest = []
    for name, model in (("liger-llama", liger_model("llama", layers=2)),
                        ("liger-qwen3", liger_model("qwen3", layers=2, window=56, sinks=8))):
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
    for name in ("liger-llama", "liger-qwen3"):
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
