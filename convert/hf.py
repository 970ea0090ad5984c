"""Hugging Face safetensors ⇄ linjax parameters, through one name table.

The table maps each HF tensor name to a parameter path of `CausalLM` and says
whether the matrix is transposed (HF `nn.Linear` stores [out, in], Flax
[in, out]). Loading fills an abstract model built with `nnx.eval_shape`, so
nothing is allocated twice; any missing, unexpected or mis-shaped tensor is an
error that lists them all.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import SafetensorError, safe_open

from linjax.config import ModelConfig
from linjax.files import check_export_directory, listing, write_directory
from linjax.model import CausalLM, abstract_model

Path = tuple  # a parameter path inside the model, e.g. ("layers", 0, "attn", "proj", "q_proj", "kernel")


def name_table(config: ModelConfig) -> dict[str, tuple[Path, bool]]:
    """HF tensor name → (linjax parameter path, transpose?) for a plain model."""
    table = {"model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
             "model.norm.weight": (("norm", "weight"), False)}
    if not config.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head", "kernel"), True)
    qkv_bias = config.attention_bias
    o_bias = config.attention_bias and config.model_type == "llama"
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        proj = ours + ("attn", "proj")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            table[f"{hf}self_attn.{name}.weight"] = (proj + (name, "kernel"), True)
            if (qkv_bias and name != "o_proj") or (o_bias and name == "o_proj"):
                table[f"{hf}self_attn.{name}.bias"] = (proj + (name, "bias"), False)
        if config.qk_norm:
            table[f"{hf}self_attn.q_norm.weight"] = (proj + ("q_norm", "weight"), False)
            table[f"{hf}self_attn.k_norm.weight"] = (proj + ("k_norm", "weight"), False)
        for name in ("gate_proj", "up_proj", "down_proj"):
            table[f"{hf}mlp.{name}.weight"] = (ours + ("mlp", name, "kernel"), True)
        table[f"{hf}input_layernorm.weight"] = (ours + ("input_layernorm", "weight"), False)
        table[f"{hf}post_attention_layernorm.weight"] = (ours + ("post_attention_layernorm", "weight"), False)
    return table


def _get(tree: dict, path: Path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: Path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def model_from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32,
                       source: str = "checkpoint") -> CausalLM:
    """Builds a `CausalLM` from HF-named tensors; strict about names and shapes."""
    graphdef, state = nnx.split(abstract_model(config, dtype=dtype))
    params = nnx.to_pure_dict(state)
    table = name_table(config)
    missing = sorted(set(table) - set(tensors))
    # Non-persistent buffers some exporters include; they carry nothing we need.
    unexpected = sorted(k for k in set(tensors) - set(table) if not k.endswith("rotary_emb.inv_freq"))
    misshaped = []
    for hf_name, (path, transpose) in table.items():
        if hf_name not in tensors:
            continue
        value = tensors[hf_name]
        value = value.T if transpose else value
        expected = _get(params, path)
        if tuple(value.shape) != tuple(expected.shape):
            misshaped.append(f"{hf_name}: expected {tuple(expected.shape)}"
                             f"{' (transposed)' if transpose else ''}, found {tuple(value.shape)}")
            continue
        _set(params, path, jnp.asarray(value, dtype=dtype))
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {listing(misshaped)}")
    if problems:
        raise ValueError(f"{source} does not match a {config.architecture} with this config: "
                         + "; ".join(problems))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def model_tensors(model: CausalLM, dtype=None) -> dict[str, np.ndarray]:
    """The model's parameters under HF names, as numpy arrays (for export)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}
    for hf_name, (path, transpose) in name_table(model.config).items():
        value = np.asarray(_get(params, path))
        if dtype is not None:
            value = value.astype(dtype)
        out[hf_name] = np.ascontiguousarray(value.T if transpose else value)
    return out


def shard_files(index: str) -> list[str]:
    """The shard file names a `model.safetensors.index.json` lists; ValueError for a broken index."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{index} is not a safetensors index (JSON with a \"weight_map\"): {err}; "
                         "download or convert the model again") from None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"{index} has no \"weight_map\" of tensor names to shard files; "
                         "download or convert the model again")
    return sorted(set(weight_map.values()))


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """All tensors of an HF model directory, single-file or sharded."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        files = shard_files(index)
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{directory!r} holds no model.safetensors or model.safetensors.index.json; "
            "linjax reads safetensors checkpoints (convert .bin files with transformers first)")
    tensors = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard {name!r} listed in the index is missing from {directory!r}")
        try:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 (safetensors' handle is not a dict)
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as err:  # a download or copy cut short, or another format under this name
            raise ValueError(f"could not read {path} ({os.path.getsize(path)} bytes): {err}. The file is truncated "
                             "or damaged; download or convert the model again") from err
    return tensors


def load_hf_directory(directory: str, dtype=jnp.float32) -> CausalLM:
    config = ModelConfig.from_hf(directory)
    return model_from_tensors(config, read_safetensors(directory), dtype, source=directory)


def write_hf_files(directory: str, config: dict, tensors: dict, tokenizer=None, extra_files=None):
    """config.json + model.safetensors (+ tokenizer files, + `extra_files` {name: source path}, e.g. modeling
    code) into an existing directory."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for name, source in (extra_files or {}).items():
        shutil.copyfile(source, os.path.join(directory, name))


def write_hf_directory(directory: str, config: dict, tensors: dict, tokenizer=None, extra_files=None) -> str:
    """An HF model directory (see `write_hf_files`), written whole and swapped in by `write_directory`."""
    return write_directory(directory, lambda staging: write_hf_files(staging, config, tensors, tokenizer,
                                                                     extra_files))


def save_hf(model: CausalLM, directory: str, tokenizer=None) -> str:
    """Writes `config.json` + `model.safetensors` (+ tokenizer files) that transformers loads.

    A linearized model has no standard architecture: `linjax.save_hf` sends it to
    `linjax.convert.export.export_hf`, which adds PyTorch modeling code (`trust_remote_code=True`)."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"save_hf expects a linjax CausalLM, got {type(model).__name__}")
    if model.linearize_config is not None:
        raise ValueError("a linearized model has no standard architecture: write it with linjax.save_hf, "
                         "which adds its modeling code")
    directory = check_export_directory(directory)
    config = model.config.to_hf()
    config["torch_dtype"] = config["dtype"] = str(model.dtype)
    write_hf_directory(directory, config, model_tensors(model), tokenizer)
    return directory
