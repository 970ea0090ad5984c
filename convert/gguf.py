"""GGUF (llama.cpp) files → HF-named tensors and config, then the HF name table.

Quantised tensors are dequantised to fp32 with the `gguf` package. llama.cpp's
converter permutes the rows of LLaMA q/k projections so its RoPE can rotate
interleaved pairs; HF (and linjax) rotate the two halves of each head, so the
permutation is undone here. Qwen2/Qwen3 GGUFs use the half-split ("NeoX")
layout already and are not permuted.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf.quants import dequantize

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def open_gguf(path: str):
    """A `gguf.GGUFReader`, with a clear error for a missing or damaged file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises bare ValueErrors/IndexErrors on damage
        raise ValueError(
            f"could not read GGUF file {path!r} ({os.path.getsize(path)} bytes): {err}. "
            "The file is truncated or not a GGUF file; download it again.") from err


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(reader, path: str = "GGUF file") -> dict:
    """An HF-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"linjax reads {sorted(_ARCHITECTURES)}")

    def get(key, default=None, required=False):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"{path}: GGUF metadata has no '{arch}.{key}', which linjax needs to build the "
                             "model; the file is incomplete or from another converter: convert the model again "
                             "with llama.cpp's convert_hf_to_gguf.py")
        return value

    def count(key, default=None, required=False, minimum=1):
        """An integer setting shared by all layers (llama.cpp stores some per layer, as arrays, for models
        whose layers differ; linjax builds models whose layers agree)."""
        value = get(key, default, required)
        if isinstance(value, list):
            raise ValueError(f"{path}: GGUF '{arch}.{key}' is a per-layer list ({_short(value)}); linjax builds "
                             "models whose layers all have the same shape")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{path}: GGUF '{arch}.{key}' must be an integer ≥ {minimum}, got {value!r}; the file "
                             "is damaged or from another converter")
        return value

    heads = count("attention.head_count", required=True)
    hidden = count("embedding_length", required=True)
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    if not vocab:
        raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens; "
                         "convert the model again with llama.cpp's convert_hf_to_gguf.py")
    config = {
        "model_type": _ARCHITECTURES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length", required=True),
        "num_hidden_layers": count("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": count("attention.key_length", hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"{path}: GGUF RoPE scaling {scaling_type!r} is not supported")
    return config


def _short(value: list) -> str:
    return repr(value[:8])[:-1] + (", ...]" if len(value) > 8 else "]")


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation.

    llama.cpp views each head's rows as [2, D/2] and transposes them to [D/2, 2]
    (interleaved rotation pairs); transposing back restores HF's two halves.
    """
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(reader, config: dict, path: str = "GGUF file") -> dict[str, np.ndarray]:
    """All tensors, dequantised to fp32, under HF names."""
    permute = config["model_type"] == "llama"
    out, unknown = {}, []
    for tensor in reader.tensors:
        name = tensor.name
        parts = name.split(".")
        kind = parts[2] if len(parts) == 4 and parts[0] == "blk" else None
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif kind in _LAYER_NAMES:
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[kind]}.{parts[3]}"
        else:
            unknown.append(name)
            continue
        try:
            value = dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:
            raise ValueError(f"{path}: could not dequantise tensor {name!r} "
                             f"({tensor.tensor_type.name}): {err}") from err
        value = np.asarray(value, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if permute and kind in ("attn_q", "attn_k") and name.endswith(".weight"):
            heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
            value = _unpermute(value, heads)
        out[hf_name] = value
    if unknown:
        raise ValueError(f"{path}: GGUF tensors linjax does not know: {unknown[:10]}"
                         f"{' ...' if len(unknown) > 10 else ''}")
    return out


_SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def load_gguf_tokenizer(path: str, reader=None):
    """The tokenizer embedded in the GGUF file, as a `transformers` fast tokenizer.

    transformers' own `from_pretrained(gguf_file=...)` imports torch; linjax must
    not need torch to load a model, so it reads the metadata with the `gguf`
    package and hands it to transformers' torch-free GGUF tokenizer builder.
    """
    try:  # transformers on use only: it takes half a second to import
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # another transformers layout: its own loader (needs torch)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    from transformers import PreTrainedTokenizerFast

    reader = reader or open_gguf(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path}: GGUF file has no tokenizer (no 'tokenizer.ggml.tokens')")
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokenizer_dict["tokens"]):
            raise ValueError(f"{path}: GGUF 'tokenizer.ggml.{key}' is {token_id}, not one of the file's "
                             f"{len(tokenizer_dict['tokens'])} tokens; the file is damaged")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
