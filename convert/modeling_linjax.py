"""A linearized linjax model in plain PyTorch, for `transformers` with `trust_remote_code=True`.

linjax's export (convert/export.py) copies this file and its siblings next to config.json
and model.safetensors, so the directory loads without JAX:

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

It reproduces linjax's forward pass in fp32 (the parity test holds it to 1e-4
max abs on the logits). What it does differently from HF's LlamaForCausalLM:
- each layer's mixer is the class registered under config.mixers[i]: the pretrained
  softmax attention, softmax over the sinks and the window alone ("window", the baseline
  without a linear term), or a linear one (gla, kgla, gdn, gdn_scalar, hedgehog),
  optionally beside exact softmax over `sinks` first tokens and a `window` of recent ones,
  the linear state then covering only positions sinks .. t − window (paper, sec. 4),
  and with `linearize.retain` > 0 a fixed number of retained tokens per kv head joining
  the softmax, chosen by score as they leave the window (docs/retention.md; token by token);
- the short-conv adapter runs on q, k, v after RoPE; a LoRA adapter is already
  merged into the q/k/v/o weights by the exporter (exact: the mixer applies it
  to both the softmax and the linear part);
- a forward over several tokens runs the linear recurrences with FLA's chunk
  kernels when CUDA is there and `fla` (flash-linear-attention) imports, and otherwise
  16 tokens at a time in PyTorch; one decode token, or `form = "recurrent"`, runs the
  token-by-token reference. The softmax parts use dense scores over the kept keys;
- `generate` decodes incrementally with `LinjaxCache`, which holds per layer what
  linjax's decode states hold (linjax/mixers/states.py LinearState): for softmax
  layers every past key and value; for linear layers the recurrent state, the
  short-conv inputs of the last K − 1 tokens, the keys and values of the sinks
  and of the window, the linear inputs (k', v', gates) of the last `window`
  tokens, which reach the state only `window` tokens later, and the retained
  slots. The cache cannot be cropped, so assisted decoding is refused; `use_cache=False` recomputes the
  whole prefix every step instead (exact, quadratic).

The files, imported relatively (transformers' remote-code loader copies them too):
    modeling_linjax_attention.py  the pretrained attention, the window baseline, the mixer registry
    modeling_linjax_linear.py     one class per linear mechanism, and its math as methods
    modeling_linjax_kernels.py    RoPE, window softmax, short conv, the recurrence's three forms
    modeling_linjax_retention.py  retained tokens: scores, admission, their softmax share
    modeling_linjax_cache.py      each layer's decode cache
Imports only torch, transformers and the standard library (`fla` optionally, on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .modeling_linjax_attention import MIXERS, RMSNorm
from .modeling_linjax_cache import LayerCache
from .modeling_linjax_kernels import fla_kernels, l2_normalize  # noqa: F401  (public: the tests use them)

# Importing the linear mechanisms registers them in MIXERS.
from .modeling_linjax_linear import FeatureMap, chunked_linear, fla_linear, linear_recurrence, run_linear  # noqa: F401

# The output field that generate feeds back as the next step's cache: `cache` from transformers 5.24 on.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"




class LinjaxConfig(PretrainedConfig):
    """The base LLaMA/Qwen sizes, the linearize settings, and each layer's mixer."""

    model_type = "linjax"

    def __init__(self, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 head_dim: int = 16, rms_norm_eps: float = 1e-6, rope: dict | None = None,
                 max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                 attention_bias: bool = False, output_bias: bool = False, qk_norm: bool = False,
                 base_model_type: str = "llama", mixers: list | None = None,
                 linearize: dict | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.rms_norm_eps = rms_norm_eps
        # {"type": default | linear | llama3, "theta", and for scaling "factor", "low_freq_factor",
        # "high_freq_factor", "original_max_position_embeddings"}; not called rope_parameters so that
        # transformers' own RoPE standardisation leaves it alone.
        self.rope = dict(rope or {"type": "default", "theta": 10000.0})
        self.max_position_embeddings = max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_bias = attention_bias  # q/k/v biases (Qwen2; LLaMA with attention_bias)
        self.output_bias = output_bias  # o_proj bias (LLaMA with attention_bias)
        self.qk_norm = qk_norm  # Qwen3's per-head RMSNorm on q and k before RoPE
        self.base_model_type = base_model_type
        self.mixers = list(mixers or ["softmax"] * num_hidden_layers)
        # linjax's LinearizeConfig as a dict; the fields read here: window, sinks, combine, adapter, conv_kernel.
        self.linearize = dict(linearize or {})
        super().__init__(**kwargs)
        if len(self.mixers) != num_hidden_layers:
            raise ValueError(f"config.mixers names {len(self.mixers)} layers; the model has {num_hidden_layers}")
        unknown = sorted(set(self.mixers) - set(MIXERS))
        if unknown:
            raise ValueError(f"unknown mixers {unknown}; this file implements {list(MIXERS)}")



class MLP(nn.Module):
    def __init__(self, config: LinjaxConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- decode cache


class LinjaxCache(Cache):
    """Decode state of every layer for `generate` (passed as past_key_values).

    Softmax layers keep a growing KV cache; linear layers a fixed-size state (`LinearLayerCache`).
    Tokens cannot be taken back out of a linear state, so `crop` (assisted decoding) is refused.
    """

    def __init__(self, config: LinjaxConfig):
        super().__init__(layers=[MIXERS[mixer].new_cache(config.linearize) for mixer in config.mixers])
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx):
        for layer in self.layers:
            layer.map_tensors(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int):
        for layer in self.layers:
            layer.map_tensors(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        for layer in self.layers:
            layer.map_tensors(lambda x: x[indices])

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("a LinjaxCache cannot drop tokens: the linear state has already absorbed "
                                  "them; decode without assisted generation, or recompute with use_cache=False")


# ----------------------------------------------------------------------------- model


class DecoderLayer(nn.Module):
    def __init__(self, config: LinjaxConfig, mixer: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MIXERS[mixer](config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, position_ids, start: int = 0, cache: LayerCache | None = None):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LinjaxModel(nn.Module):
    def __init__(self, config: LinjaxConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, m) for m in config.mixers])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, position_ids, cache: LinjaxCache | None = None):
        """Hidden states of input_ids [B,T], which follow the cache's tokens (if any); advances the cache."""
        start = 0 if cache is None else cache.seen_tokens
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, position_ids, start, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        return self.norm(x)


class LinjaxPreTrainedModel(PreTrainedModel):
    config_class = LinjaxConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _is_stateful = True  # transformers: no assisted decoding (a linear state cannot be rolled back)

    def _init_weights(self, module):
        # Every tensor comes from the checkpoint; nothing to initialise.
        pass


class LinjaxForCausalLM(LinjaxPreTrainedModel, GenerationMixin):
    """Tokens [B,T] → logits [B,T,vocab]; with use_cache, also the `LinjaxCache` to continue from."""

    def __init__(self, config: LinjaxConfig):
        super().__init__(config)
        self.model = LinjaxModel(config)
        # Tied embeddings reuse embed_tokens in forward instead of a second (tied) module.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not build a DynamicCache: forward creates a LinjaxCache on the first call.
        return False

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                past_key_values=None, use_cache=None, logits_to_keep: int = 0, return_dict=None, cache=None,
                **kwargs):
        # transformers ≥ 5.24 names the decode cache `cache` (in generate's inputs and in the output);
        # earlier versions `past_key_values`. Both are accepted and the output carries the one it has.
        past_key_values = cache if cache is not None else past_key_values
        if input_ids is None:
            raise ValueError("LinjaxForCausalLM needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padding is not supported (the linear state has no mask): pass unpadded "
                             "rows of equal length, or one row at a time")
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True)
        cache = past_key_values
        if cache is not None and not isinstance(cache, LinjaxCache):
            if cache.get_seq_length() != 0:
                raise ValueError(f"past_key_values must be a LinjaxCache (or empty); got a {type(cache).__name__} "
                                 f"holding {cache.get_seq_length()} tokens")
            cache = None  # e.g. an empty DynamicCache(): replaced by the state this model needs
        if cache is None and use_cache:
            cache = LinjaxCache(self.config)
        b, t = input_ids.shape
        if position_ids is None:
            start = 0 if cache is None else cache.seen_tokens
            position_ids = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        h = self.model(input_ids, position_ids, cache)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = F.linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None,
                                      next_sequence_length=None, logits_to_keep=None, cache=None, **kwargs):
        past_key_values = cache if cache is not None else past_key_values  # see `forward`
        # With a cache only the tokens it has not seen go in (generate passes the whole sequence so far).
        if next_sequence_length is not None:
            input_ids = input_ids[:, -next_sequence_length:]
        elif isinstance(past_key_values, LinjaxCache) and 0 < past_key_values.seen_tokens < input_ids.shape[1]:
            input_ids = input_ids[:, past_key_values.seen_tokens:]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                  "use_cache": use_cache}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs
