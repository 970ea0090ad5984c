"""Model configuration: a frozen dataclass read from a Hugging Face config.

`ModelConfig.from_hf` is strict, in the manner of penzai's LLaMA conversion:
every field of the HF config is either used, known to be harmless, or at a
value that changes nothing; anything else raises an error that names it, so a
checkpoint whose architecture we do not implement is never silently loaded
as something else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Fields that describe bookkeeping, tokenisation or generation, not the network.
_HARMLESS_FIELDS = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "torchscript", "tie_encoder_decoder", "pruned_heads", "add_cross_attention",
    "cross_attention_hidden_size", "is_decoder", "finetuning_task", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "model_type",
    "max_position_embeddings", "pretraining_tp", "max_window_layers", "sliding_window",
    "bad_words_ids", "begin_suppress_tokens", "diversity_penalty", "do_sample",
    "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values",
    "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "temperature",
    "top_k", "top_p", "typical_p", "tf_legacy_loss", "use_bfloat16",
}
# Fields the model does not implement, accepted only at the value that makes them a no-op.
_NO_OP_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "attention_dropout": (0.0, 0),
    "use_sliding_window": (False,),
    "partial_rotary_factor": (1.0, 1),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of a LLaMA/Qwen decoder; field names follow Hugging Face."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # `linear` and `llama3` scaling parameters; unused for `default`.
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and, for LLaMA, o) projection biases
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; linjax implements "
                f"{sorted(SUPPORTED_MODEL_TYPES)} (LLaMA-family and Qwen2/Qwen3 decoders)")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE type {self.rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"model config: {name} must be an integer ≥ 1, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "rope_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"model config: {name} must be a finite number > 0, got {value!r}")
        for name in ("bos_token_id", "eos_token_id"):
            # An id outside the vocabulary would index past the embedding table (JAX clamps, silently).
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else () if value is None else (value,)
            if not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"model config: {name} must be a token id in [0, vocab_size={self.vocab_size}) "
                                 f"or a list of them, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def architecture(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Builds the config from an HF config (dict, `transformers` config, or path to config.json)."""
        fields = _hf_config_dict(hf_config)
        model_type = fields.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = fields.get("architectures")
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} (architectures={archs}); "
                f"linjax converts {sorted(SUPPORTED_MODEL_TYPES)} models")
        unknown = []
        for key, value in fields.items():
            if key in _NO_OP_VALUES:
                if value not in _NO_OP_VALUES[key]:
                    unknown.append(f"{key}={value!r} (only {list(_NO_OP_VALUES[key])} is implemented)")
            elif key == "layer_types":
                if any(t != "full_attention" for t in value or []):
                    unknown.append(f"layer_types={sorted(set(value))} (only full_attention is implemented)")
            elif key == "auto_map":  # transformers would build the model from the directory's own code
                if value:
                    unknown.append(f"auto_map={_short(value)} (the directory's own modeling code defines this "
                                   "model; linjax does not run it)")
            elif key == "quantization_config":
                unknown.append("quantization_config (load an unquantised checkpoint)")
            elif key == "attention_bias" and model_type == "qwen2":
                unknown.append("attention_bias (Qwen2 always has q/k/v biases)")
            elif key not in _HANDLED_FIELDS and key not in _HARMLESS_FIELDS:
                unknown.append(f"{key}={_short(value)}")
        if unknown:
            raise ValueError(
                f"HF config ({model_type}) has fields linjax does not implement: "
                + "; ".join(unknown)
                + ". Converting would silently change the model; please open an issue with the config.")

        absent = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads") if fields.get(k) is None]
        if absent:
            raise ValueError(f"HF config ({model_type}) lacks {', '.join(absent)}; it is incomplete")
        heads = fields["num_attention_heads"]
        rope = _rope_parameters(fields)
        eos = fields.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=fields["vocab_size"],
            hidden_size=fields["hidden_size"],
            intermediate_size=fields["intermediate_size"],
            num_hidden_layers=fields["num_hidden_layers"],
            num_attention_heads=heads,
            # Absent (None) means one key/value head per query head; 0 is an error that __post_init__ names.
            num_key_value_heads=_default_if_none(fields.get("num_key_value_heads"), heads),
            head_dim=fields.get("head_dim") or _divide(fields["hidden_size"], heads),
            rms_norm_eps=fields.get("rms_norm_eps", 1e-6),
            max_position_embeddings=fields.get("max_position_embeddings", 2048),
            tie_word_embeddings=fields.get("tie_word_embeddings", False),
            attention_bias=True if model_type == "qwen2" else fields.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            bos_token_id=fields.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            **rope,
        )

    def to_hf(self) -> dict:
        """The config.json `transformers` reads for the plain (not linearized) model."""
        rope_parameters = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type in ("linear", "llama3"):
            rope_parameters["factor"] = self.rope_factor
        if self.rope_type == "llama3":
            rope_parameters.update(
                low_freq_factor=self.rope_low_freq_factor,
                high_freq_factor=self.rope_high_freq_factor,
                original_max_position_embeddings=self.rope_original_max_position_embeddings)
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta/rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "rope_scaling": None if self.rope_type == "default" else dict(rope_parameters),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if self.model_type != "qwen2":
            out["attention_bias"] = self.attention_bias
        return out


_HANDLED_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias",
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _default_if_none(value, default):
    return default if value is None else value


def _divide(hidden_size, heads):
    """hidden_size // heads, the head size HF assumes without head_dim; bad values are left for __post_init__."""
    return hidden_size // heads if _is_int(hidden_size) and _is_int(heads) and heads > 0 else hidden_size


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _hf_config_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no HF config at {path!r}: expected a config.json file or a folder holding one")
        with open(path) as f:
            return json.load(f)
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected an HF config (dict, transformers config or config.json path), got {type(hf_config)}")


def _rope_parameters(fields: dict) -> dict:
    """Reads RoPE settings from either spelling (`rope_parameters`, or `rope_theta` + `rope_scaling`)."""
    params = dict(fields.get("rope_parameters") or {})
    scaling = fields.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", fields.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE type {rope_type!r} in the HF config; linjax implements {list(SUPPORTED_ROPE_TYPES)}")
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings"}
    extra = sorted(set(merged) - known)
    if extra and not (extra == ["partial_rotary_factor"] and merged["partial_rotary_factor"] == 1.0):
        raise ValueError(f"RoPE parameters linjax does not implement: {extra}")
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(merged["factor"])
    if rope_type == "llama3":
        out.update(
            rope_low_freq_factor=float(merged["low_freq_factor"]),
            rope_high_freq_factor=float(merged["high_freq_factor"]),
            rope_original_max_position_embeddings=int(merged["original_max_position_embeddings"]))
    return out


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """A tiny model for tests and examples: 2 layers, width 64, vocab 128."""
    base = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                qk_norm=model_type == "qwen3", attention_bias=model_type == "qwen2")
    base.update(overrides)
    return ModelConfig(**base)
