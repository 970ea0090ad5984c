"""Conversion: GGUF reading, strictness, parameter counts of real configs, clear errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import ModelConfig
from linjax.convert import gguf as gguf_convert
from linjax.convert.hf import model_from_tensors, read_safetensors
from tests.conftest import hf_config, save_random_hf_model, torch_logits
from tests.helpers import relative_rms, require_module

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs")


def llama_cpp_permute(weight, heads):
    """What llama.cpp's converter does to LLaMA q/k rows (written from its description)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(torch_model, config, path):
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for name, tensor in torch_model.state_dict().items():
        value = tensor.detach().numpy().astype(np.float32)
        if name in names:
            writer.add_tensor(names[name], value)
            continue
        _, _, i, *rest = name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if module == "self_attn.q_proj":
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif module == "self_attn.k_proj":
            value = llama_cpp_permute(value, config.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.{layer[module]}.{kind}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    require_module("torch")
    config = hf_config("llama", tie_word_embeddings=False)
    torch_model = save_random_hf_model(config, str(tmp_path / "hf"))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(torch_model, config, path)
    return path, torch_model


def test_gguf_unpermutes_llama_qk_and_matches_transformers(tiny_gguf):
    path, torch_model = tiny_gguf
    reader = gguf_convert.open_gguf(path)
    config = gguf_convert.gguf_hf_config(reader, path)
    model = model_from_tensors(ModelConfig.from_hf(config), gguf_convert.gguf_tensors(reader, config, path))
    tokens = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 37), dtype=np.int32)
    ours, theirs = np.asarray(model(jnp.asarray(tokens))), torch_logits(torch_model, tokens)
    assert relative_rms(ours, theirs) <= 1e-5
    assert np.max(np.abs(ours - theirs)) <= 1e-4


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or not a GGUF"):
        linjax.load(str(truncated))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen3-0.6b", "qwen3-8b"])
def test_parameter_counts_match_transformers(name):
    torch = require_module("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(FIXTURES, f"{name}.json")
    abstract = linjax.abstract_model(path)  # nnx.eval_shape: no parameter memory
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))
    with open(path) as f:
        fields = json.load(f)
    hf = AutoConfig.for_model(fields.pop("model_type"), **{k: v for k, v in fields.items()
                                                          if k not in ("architectures", "transformers_version")})
    with torch.device("meta"):
        torch_model = AutoModelForCausalLM.from_config(hf)
    expected = sum(p.numel() for p in torch_model.parameters())
    assert linjax.parameter_count(abstract) == expected


def test_unsupported_architecture_names_it():
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12}
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        ModelConfig.from_hf(gpt2)


def test_unsupported_rope_type_names_it():
    fields = json.load(open(os.path.join(FIXTURES, "qwen3-0.6b.json")))
    fields["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        ModelConfig.from_hf(fields)


def test_unknown_config_field_names_it():
    fields = json.load(open(os.path.join(FIXTURES, "llama-3.2-1b.json")))
    fields["sliding_window_pattern"] = 4
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        ModelConfig.from_hf(fields)
    fields = json.load(open(os.path.join(FIXTURES, "llama-3.2-1b.json")))
    fields["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(fields)


def test_missing_and_misshaped_tensors_are_listed(tmp_path):
    require_module("torch")
    from safetensors.numpy import save_file

    save_random_hf_model(hf_config("llama"), str(tmp_path))
    tensors = read_safetensors(str(tmp_path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = np.ones(63, np.float32)
    tensors["model.layers.0.self_attn.extra.weight"] = np.ones(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        linjax.load(str(tmp_path))
    message = str(err.value)
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors (1): model.layers.0.self_attn.extra.weight" in message
    assert "model.norm.weight: expected (64,), found (63,)" in message


def test_nonexistent_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        linjax.load(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        linjax.load(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        linjax.load(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="dtype must be"):
        linjax.load(str(tmp_path / "empty"), dtype="float16")


def test_linjax_checkpoint_round_trip(tmp_path):
    require_module("torch")
    from linjax.convert.checkpoint import save_checkpoint

    save_random_hf_model(hf_config("qwen3"), str(tmp_path / "hf"))
    model, _ = linjax.load(str(tmp_path / "hf"))
    save_checkpoint(model, str(tmp_path / "ckpt"))
    restored, _ = linjax.load(str(tmp_path / "ckpt"))
    tokens = jnp.asarray(np.arange(20, dtype=np.int32)[None] % model.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(restored(tokens)), np.asarray(model(tokens)))
    bf16, _ = linjax.load(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert bf16.dtype == jnp.bfloat16 and relative_rms(np.asarray(bf16(tokens), np.float32),
                                                        np.asarray(model(tokens))) < 3e-2
