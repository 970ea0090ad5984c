"""Export a linearized model to a Hugging Face directory that PyTorch loads without JAX.

    linjax.save_hf(model, "out/", tokenizer)        # dispatches here when the model is linearized
    AutoModelForCausalLM.from_pretrained("out/", trust_remote_code=True)

The directory holds config.json (model_type "linjax", `auto_map` pointing at the copied
modeling_linjax.py, which imports its modeling_linjax_*.py siblings, copied too),
model.safetensors and the tokenizer files. Base tensors keep their HF names
(convert/hf.py's table); each layer's mixer adds its own (`torch_tensors`: the mechanism's
parameters, e.g. self_attn.gate_down.weight, as the PyTorch mirror's class for it names them,
self_attn.{q,k,v}_conv.{weight,bias} for the short conv in torch's Conv1d layout and
self_attn.output_gain), all in torch's [out, in] layout. LoRA has no tensors of its own:
W + (alpha/rank)·A·B is merged into q/k/v/o_proj, which is exact because the mixer applies
the adapted projections everywhere it uses them. Everything is written in float32, the dtype
the linear mixers compute in. config.json's `linearize` carries every LinearizeConfig setting,
retained tokens (`retain`, `retain_score`) included: the mirror keeps them as linjax does
(convert/modeling_linjax_retention.py).
"""

from __future__ import annotations

import glob
import os

import numpy as np

from linjax.convert.hf import model_tensors, write_hf_directory
from linjax.files import check_export_directory
from linjax.layers import torch_linear_tensors as _linear  # noqa: F401  (tests/test_hedgehog_map.py)
from linjax.linearize import mixer_names

# modeling_linjax.py and the siblings it imports relatively: transformers copies those into its module
# cache only if they lie beside it in the export directory.
MODELING_FILES = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_linjax*.py")))


def export_config(model) -> dict:
    """config.json for modeling_linjax.LinjaxConfig."""
    c = model.config
    rope = {"type": c.rope_type, "theta": c.rope_theta}
    if c.rope_type in ("linear", "llama3"):
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position_embeddings)
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    return {
        "architectures": ["LinjaxForCausalLM"],
        "model_type": "linjax",
        "auto_map": {"AutoConfig": "modeling_linjax.LinjaxConfig",
                     "AutoModelForCausalLM": "modeling_linjax.LinjaxForCausalLM"},
        "base_model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope": rope,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "output_bias": c.attention_bias and c.model_type == "llama",
        "qk_norm": c.qk_norm,
        "mixers": mixer_names(model),
        "linearize": model.linearize_config.to_dict(),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,  # generate decodes incrementally with modeling_linjax.LinjaxCache
    }


def export_tensors(model) -> dict:
    """Every tensor of the export, float32, under the names modeling_linjax.py expects."""
    tensors = model_tensors(model, dtype=np.float32)
    for i, block in enumerate(model.layers):
        tensors.update(block.attn.torch_tensors(f"model.layers.{i}.self_attn", tensors))
    return tensors


def export_hf(model, directory: str, tokenizer=None) -> str:
    """Writes config.json, model.safetensors, modeling_linjax*.py (+ tokenizer) atomically; returns the path."""
    if getattr(model, "linearize_config", None) is None:
        raise ValueError("export_hf writes linearized models; a plain model exports as its own "
                         "architecture with linjax.save_hf")
    directory = check_export_directory(directory)
    write_hf_directory(directory, export_config(model), export_tensors(model), tokenizer,
                       extra_files={os.path.basename(path): path for path in MODELING_FILES})
    return directory

