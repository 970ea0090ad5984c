"""Logits parity with transformers on tiny random LLaMA / Qwen models, and bf16 compute."""

import jax.numpy as jnp
import numpy as np
import pytest

import linjax
from tests.conftest import hf_config, save_random_hf_model, torch_logits
from tests.helpers import relative_rms, require_module

require_module("torch")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

CASES = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama3-rope-scaling": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-untied-mqa": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
}


def random_tokens(vocab, batch=2, length=37, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    torch_model = save_random_hf_model(hf_config(model_type, **overrides), str(tmp_path))
    model, _ = linjax.load(str(tmp_path))
    tokens = random_tokens(model.config.vocab_size)
    ours = np.asarray(model(jnp.asarray(tokens)))
    theirs = torch_logits(torch_model, tokens)
    assert ours.shape == (2, 37, model.config.vocab_size)
    assert relative_rms(ours, theirs) <= 1e-5
    assert np.max(np.abs(ours - theirs)) <= 1e-4


def test_round_trip_through_save_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    save_random_hf_model(hf_config("qwen3", tie_word_embeddings=False), str(tmp_path / "src"))
    model, _ = linjax.load(str(tmp_path / "src"))
    linjax.save_hf(model, str(tmp_path / "out"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").float()
    tokens = random_tokens(model.config.vocab_size, seed=1)
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert np.max(np.abs(torch_logits(reloaded, tokens) - ours)) <= 1e-5


def test_round_trip_llama3_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    save_random_hf_model(hf_config("llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
                         str(tmp_path / "src"))
    model, _ = linjax.load(str(tmp_path / "src"))
    linjax.save_hf(model, str(tmp_path / "out"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").float()
    tokens = random_tokens(model.config.vocab_size, seed=2)
    assert np.max(np.abs(torch_logits(reloaded, tokens) - np.asarray(model(jnp.asarray(tokens))))) <= 1e-5


def test_bfloat16_compute_close_to_float32(tmp_path):
    save_random_hf_model(hf_config("llama"), str(tmp_path))
    model32, _ = linjax.load(str(tmp_path))
    model16, _ = linjax.load(str(tmp_path), dtype="bfloat16")
    assert model16.embed_tokens.embedding[...].dtype == jnp.bfloat16
    tokens = jnp.asarray(random_tokens(model32.config.vocab_size))
    logits16 = model16(tokens)
    assert logits16.dtype == jnp.bfloat16
    assert relative_rms(np.asarray(logits16, np.float32), np.asarray(model32(tokens))) < 3e-2


def test_kv_cache_decoding_matches_full_forward(tmp_path):
    from linjax.generate import generate

    save_random_hf_model(hf_config("qwen3"), str(tmp_path))
    model, _ = linjax.load(str(tmp_path))
    prompt = jnp.asarray(random_tokens(model.config.vocab_size, length=9, seed=3))
    out = np.asarray(generate(model, prompt, 6))
    # Each generated token is the argmax of a full forward (no cache) over everything before it.
    predicted = np.asarray(model(jnp.asarray(out))).argmax(-1)
    np.testing.assert_array_equal(out[:, 9:], predicted[:, 8:-1])
    tokens = jnp.asarray(out)
    # Prefill split at any point plus one-token steps equals one full pass.
    states = model.init_states(2, 15)
    first, states = model(tokens[:, :4], states=states)
    second, states = model(tokens[:, 4:11], states=states)
    third, states = model(tokens[:, 11:12], states=states)
    stitched = np.concatenate([np.asarray(first), np.asarray(second), np.asarray(third)], axis=1)
    assert relative_rms(stitched, np.asarray(model(tokens[:, :12]))) < 1e-5
