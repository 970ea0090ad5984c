"""A linearized linjax model in plain PyTorch, for `transformers` with `trust_remote_code=True`.

linjax's export (convert/export.py) copies this file next to config.json and
model.safetensors, so the directory loads without JAX:

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

It reproduces linjax's forward pass in fp32 (the parity test holds it to 1e-4
max abs on the logits). What it does differently from HF's LlamaForCausalLM:
- each layer's mixer is the pretrained softmax attention, softmax over the sinks
  and the window alone ("window", the baseline without a linear term), or a linear
  one (config.mixers[i]: gla, kgla, gdn, gdn_scalar, hedgehog), optionally
  beside exact softmax over `sinks` first tokens and a `window` of recent ones,
  the linear state then covering only positions sinks .. t − window (paper, sec. 4);
- the short-conv adapter runs on q, k, v after RoPE; a LoRA adapter is already
  merged into the q/k/v/o weights by the exporter (exact: the mixer applies it
  to both the softmax and the linear part);
- a forward over several tokens runs the linear recurrences with FLA's chunk
  kernels when CUDA is there and `fla` (flash-linear-attention) imports
  (`fla_linear`), and otherwise 16 tokens at a time in PyTorch (`chunked_linear`);
  one decode token, or `form = "recurrent"`, runs `linear_recurrence`, the
  token-by-token reference. The softmax parts use dense scores over the kept keys;
- `generate` decodes incrementally with `LinjaxCache`, which holds per layer what
  linjax's decode states hold (linjax/mixers/states.py LinearState): for softmax
  layers every past key and value; for linear layers the recurrent state, the
  short-conv inputs of the last K − 1 tokens, the keys and values of the sinks
  and of the window, and the linear inputs (k', v', gates) of the last `window`
  tokens, which reach the state only `window` tokens later. The cache cannot be
  cropped, so assisted decoding is refused; `use_cache=False` recomputes the
  whole prefix every step instead (exact, quadratic).

Kernel math (linjax/kernels/*.py), per query head h reading kv head h // (H // Hkv),
state S_t including token t, o_t = scale · S_tᵀ q_t, scale = the config's `linearize.scale`
or by default Dk^-1/2 (1 for Hedgehog):
    GLA        S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ
    kGLA       GLA with the decay α_t ⊙ max(1 − β_t k_t², 1e-6)
    GDN        S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ   (α per channel)
    gdn_scalar the same with one α per head
    Hedgehog   S_t = Σ φ(k_i)[v_i, 1]ᵀ, normalised by the last column
With `linearize.output_gain`, o_t is multiplied by a learned per-head gain (`self_attn.output_gain`).
Imports only torch, transformers and the standard library (`fla` optionally, on CUDA).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

LINEAR_MIXERS = ("gla", "kgla", "gdn", "gdn_scalar", "hedgehog")
# The output field that generate feeds back as the next step's cache: `cache` from transformers 5.24 on.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
KEY_GATE_FLOOR = 1e-6  # kGLA: 1 − β k² is floored here (kernels/kgla.py)
_MASKED = -1e30  # the window softmax's finite "−inf" (kernels/swa.py)


class LinjaxConfig(PretrainedConfig):
    """The base LLaMA/Qwen sizes, the linearize settings, and each layer's mixer."""

    model_type = "linjax"

    def __init__(self, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 head_dim: int = 16, rms_norm_eps: float = 1e-6, rope: Optional[dict] = None,
                 max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                 attention_bias: bool = False, output_bias: bool = False, qk_norm: bool = False,
                 base_model_type: str = "llama", mixers: Optional[list] = None,
                 linearize: Optional[dict] = None, **kwargs):
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
        unknown = sorted(set(self.mixers) - set(LINEAR_MIXERS) - {"softmax", "window"})
        if unknown:
            raise ValueError(f"unknown mixers {unknown}; this file implements softmax, window and "
                             f"{list(LINEAR_MIXERS)}")


# ----------------------------------------------------------------------------- shared layers


class RMSNorm(nn.Module):
    """x / rms(x) · w with fp32 statistics (linjax.layers.RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inverse_frequencies(rope: dict, dim: int) -> torch.Tensor:
    """[dim/2] inverse frequencies for default, linear and Llama-3.1 (llama3) RoPE."""
    inv_freq = 1.0 / (float(rope["theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = rope.get("type", "default")
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if kind != "default":
        raise ValueError(f"unsupported RoPE type {kind!r}; expected default, linear or llama3")
    return inv_freq


def apply_rope(x, positions, inv_freq):
    """x [B,T,N,D] rotated by positions [B,T]; HF's half-split layout."""
    angles = positions.float()[..., None] * inv_freq.to(x.device)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, config: LinjaxConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def expand_kv(x, heads: int):
    """[B,T,Hkv,D] → [B,T,H,D]: query head h reads kv head h // (H // Hkv)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def window_softmax_parts(q, k, v, query_positions, key_positions, sinks: int, window: Optional[int]):
    """Unnormalised softmax over I_t = {j ≤ t : j < sinks or t − j < window} (window None: all j ≤ t).

    q [B,T,H,D] at query_positions [T]; k, v [B,L,Hkv,D] at key_positions [L] (the new tokens'
    keys and any cached ones). Dense [T, L] scores. Returns fp32 (numerator [B,T,H,Dv],
    row_max [B,T,H], row_sum [B,T,H]) as kernels/swa.py's SoftmaxParts.
    """
    H, D = q.shape[2], q.shape[3]
    k, v = expand_kv(k.float(), H), expand_kv(v.float(), H)
    scores = torch.einsum("bthd,bjhd->bhtj", q.float(), k) * D ** -0.5
    t, j = query_positions[:, None], key_positions[None, :]
    mask = j <= t
    if window is not None:
        mask = mask & ((j < sinks) | (t - j < window))
    scores = scores.masked_fill(~mask, _MASKED)
    row_max = scores.amax(-1)
    p = torch.exp(scores - row_max[..., None]) * mask
    numerator = torch.einsum("bhtj,bjhe->bthe", p, v)
    return numerator, row_max.transpose(1, 2), p.sum(-1).transpose(1, 2)


def token_positions(start: int, length: int, device) -> torch.Tensor:
    """Positions start .. start + length − 1 of the tokens in this call (the masks and the shift use them)."""
    return torch.arange(start, start + length, device=device)


# ----------------------------------------------------------------------------- decode cache


class LayerCache:
    """One layer's part of `LinjaxCache`; the flags are what transformers' Cache asks of its layers."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def tensors(self) -> dict:
        """The batch-first tensors held, by attribute name (None entries: not filled yet)."""
        raise NotImplementedError

    def map_tensors(self, fn):
        """Applies fn to every held tensor along the batch axis (beam reordering, batch selection)."""
        for name, value in self.tensors().items():
            if isinstance(value, list):
                setattr(self, name, [fn(x) for x in value])
            elif isinstance(value, dict):
                setattr(self, name, {key: fn(x) for key, x in value.items()})
            elif value is not None:
                setattr(self, name, fn(value))

    def get_seq_length(self) -> int:
        raise NotImplementedError("LinjaxCache counts tokens for all layers: call cache.get_seq_length()")

    def get_max_length(self) -> int:
        return -1  # no fixed size: softmax layers grow, the others keep a bounded state


class KeyValueCache(LayerCache):
    """Post-RoPE keys/values [B,L,Hkv,D] with their positions [L] that later queries attend to:
    all of them (window None: full softmax attention), or the first `sinks` and the last `window`
    (kernels/swa.py WindowCache, kept in position order instead of a ring)."""

    def __init__(self, sinks: int = 0, window: Optional[int] = None):
        self.sinks, self.window = sinks, window
        self.keys = self.values = self.positions = None
        self.length = 0  # tokens seen

    def tensors(self):
        return {"keys": self.keys, "values": self.values}

    def reset(self):
        self.keys = self.values = self.positions = None
        self.length = 0

    def extend(self, k, v, positions):
        """(keys, values, key positions) to attend over, the new ones last; keeps what later tokens need."""
        self.length += k.shape[1]
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
            positions = torch.cat([self.positions, positions])
        kept = (k, v, positions)
        if self.window is not None:
            # Held: positions 0 .. head − 1 (sinks not yet in the window) and the `tail` latest, in order.
            last = self.length - 1
            head, tail = max(0, min(self.sinks, last - self.window + 1)), min(self.window, self.length)
            kept = tuple(torch.cat([x[:, :head], x[:, x.shape[1] - tail:]], dim=1) for x in (k, v))
            kept += (torch.cat([positions[:head], positions[positions.shape[0] - tail:]]),)
        self.keys, self.values, self.positions = kept
        return k, v, positions


class LinearLayerCache(LayerCache):
    """A linear layer's decode state, linjax's LinearState: its size does not grow with the context."""

    def __init__(self, sinks: int, window: int):
        self.recurrent = None  # S [B,H,Dk',Dv'] (fp32) over positions sinks .. t − window
        self.conv = None  # {"q","k","v"}: short-conv inputs of the last K − 1 tokens [B,K−1,C] (fp32)
        self.window = KeyValueCache(sinks, window) if window else None  # the sinks' and the window's k, v
        self.shifted = None  # [k', v', *gates] of the last `window` tokens, oldest first [B,window,...]

    def tensors(self):
        return {"recurrent": self.recurrent, "conv": self.conv, "shifted": self.shifted}

    def map_tensors(self, fn):
        super().map_tensors(fn)
        if self.window is not None:
            self.window.map_tensors(fn)

    def reset(self):
        self.recurrent = self.conv = self.shifted = None
        if self.window is not None:
            self.window.reset()


class LinjaxCache(Cache):
    """Decode state of every layer for `generate` (passed as past_key_values).

    Softmax layers keep a growing KV cache; linear layers a fixed-size state (`LinearLayerCache`).
    Tokens cannot be taken back out of a linear state, so `crop` (assisted decoding) is refused.
    """

    def __init__(self, config: "LinjaxConfig"):
        settings = config.linearize
        window, sinks = int(settings.get("window", 0)), int(settings.get("sinks", 0))
        layer_cache = {"softmax": lambda: KeyValueCache(), "window": lambda: KeyValueCache(sinks, window)}
        super().__init__(layers=[layer_cache.get(mixer, lambda: LinearLayerCache(sinks, window))()
                                 for mixer in config.mixers])
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
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


class Attention(nn.Module):
    """The pretrained q/k/v/o projections (with q/k norm and RoPE), and full causal softmax attention."""

    sinks, window = 0, None  # attend to every earlier token

    def __init__(self, config: LinjaxConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.output_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Recomputed per call, not a buffer: transformers builds the model on the meta device and
        # would leave a non-persistent buffer uninitialised.
        self.rope = config.rope

    def qkv(self, x, positions):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inverse_frequencies(self.rope, self.head_dim)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x, position_ids, start: int = 0, cache: Optional[KeyValueCache] = None):
        """x [B,T,d] at positions start .. start + T − 1 (after `cache`'s tokens, if one is given)."""
        q, k, v = self.qkv(x, position_ids)
        positions = token_positions(start, x.shape[1], x.device)
        keys, values, key_positions = (k, v, positions) if cache is None else cache.extend(k, v, positions)
        numerator, _, row_sum = window_softmax_parts(q, keys, values, positions, key_positions, self.sinks,
                                                     self.window)
        return self.out((numerator / row_sum[..., None]).to(x.dtype))


class WindowAttention(Attention):
    """Softmax over the first `sinks` tokens and the last `window` only, no linear term (linjax/mixers/window.py)."""

    def __init__(self, config: LinjaxConfig):
        super().__init__(config)
        self.window, self.sinks = int(config.linearize["window"]), int(config.linearize.get("sinks", 0))


# ----------------------------------------------------------------------------- linear mixers


class FeatureMap(nn.Module):
    """Hedgehog's φ(x) = softmax([2z, −2z]), z = xW + b, shared by the heads (FLA's HedgehogFeatureMap)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.proj = nn.Linear(head_dim, head_dim)

    def forward(self, x):
        z = 2 * self.proj(x.float())
        return torch.cat([z, -z], dim=-1).softmax(-1)


def l2_normalize(x, eps: float = 1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(x, conv: nn.Conv1d, history=None):
    """Depthwise causal conv over time: x [B,T,N,D] → (y [B,T,N,D], the last K − 1 inputs [B,K−1,N·D]), fp32.

    `history`: the K − 1 inputs before x (zeros for a fresh sequence), as returned by the previous call.
    K shifted multiply-adds, as kernels/conv.py (cheaper than a conv call for one decode token).
    """
    b, t, n, d = x.shape
    K = conv.kernel_size[0]
    x = x.float().reshape(b, t, n * d)
    if history is None:
        history = x.new_zeros(b, K - 1, n * d)
    padded = torch.cat([history, x], dim=1)
    weight = conv.weight.float()[:, 0, :]  # [C, K]; tap K − 1 multiplies the current token
    y = conv.bias.float() + sum(weight[:, i] * padded[:, i:i + t] for i in range(K))
    return y.reshape(b, t, n, d), padded[:, t:]


def shift_linear_inputs(inputs, sinks: int, window: int, start: int = 0, history=None):
    """The linear inputs (k', v', *gates) [B,T,...] at positions start .. start + T − 1, delayed by `window`.

    Entry t gets the token at t − window (zeros before the sequence), its key zeroed if it is a
    sink: the linear state at t then covers positions sinks .. t − window (kernels/swa.py).
    `history`: the same inputs of the `window` tokens before `start` (None: a fresh sequence).
    Returns (shifted inputs, the history for the next call).
    """
    T = inputs[0].shape[1]
    if history is None:
        history = [x.new_zeros((x.shape[0], window) + tuple(x.shape[2:])) for x in inputs]
    joined = [torch.cat([h, x], dim=1) for h, x in zip(history, inputs)]
    shifted = [x[:, :T] for x in joined]
    source = token_positions(start, T, inputs[0].device) - window
    keep = (source >= sinks).to(shifted[0].dtype).view(1, T, *([1] * (shifted[0].dim() - 2)))
    shifted[0] = shifted[0] * keep
    return shifted, [x[:, -window:] for x in joined]


def log_decay_per_channel(kind: str, k, gates):
    """[B,T,H,Dk]: log of the per-channel decay of the state (GDN's β erase enters separately)."""
    B, T, H, Dk = k.shape
    if kind in ("gla", "kgla", "gdn"):
        log_decay = gates[0]
    elif kind == "gdn_scalar":
        log_decay = gates[0][..., None].expand(B, T, H, Dk)
    else:  # hedgehog
        log_decay = torch.zeros_like(k)
    if kind == "kgla":  # kernels/kgla.py key_log_gate
        erase = gates[1][..., None] * k * k
        log_decay = log_decay + torch.log1p(-torch.clamp(erase, max=1.0 - KEY_GATE_FLOOR))
    return log_decay


def linear_recurrence(kind: str, q, k, v, gates, scale: float, initial_state=None):
    """(o [B,T,H,Dv], final state [B,H,Dk,Dv]) of the mechanism's recurrence, token by token (fp32).

    q [B,T,H,Dk], k and v on the H query heads, gates [B,T,H,Dk] or [B,T,H];
    initial_state: S before the first token (None: zeros).
    """
    B, T, H, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]
        if kind in ("gla", "kgla"):
            decay = torch.exp(gates[0][:, t])
            if kind == "kgla":
                erase = gates[1][:, t, :, None] * kt * kt
                decay = decay * torch.clamp(1.0 - erase, min=KEY_GATE_FLOOR)
            S = decay[..., None] * S + kt[..., :, None] * vt[..., None, :]
        elif kind in ("gdn", "gdn_scalar"):
            log_alpha = gates[0][:, t]
            alpha = torch.exp(log_alpha if kind == "gdn" else log_alpha[..., None])
            S = alpha[..., None] * S
            err = vt - torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + kt[..., :, None] * (gates[1][:, t, :, None] * err)[..., None, :]
        else:  # hedgehog: no decay
            S = S + kt[..., :, None] * vt[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(outs, dim=1), S


def chunked_linear(kind: str, q, k, v, gates, scale: float, initial_state=None, chunk: int = 16):
    """`linear_recurrence`'s (o, final state) computed a chunk at a time (same arguments; fp32).

    Inside a chunk, with G_i = Σ_{t≤i} log α_t (per channel, from the chunk start) and S_0 the
    state before it, every exponent below is a sum of log-gates over the span it decays, so ≤ 0:
        o_i = scale · [(q_i ⊙ e^{G_i})ᵀ S_0 + Σ_{j≤i} (Σ_d q_id k_jd e^{G_id − G_jd}) u_j]
        S_C = Diag(e^{G_C}) S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) u_jᵀ
    with u_j = v_j for GLA / kGLA / Hedgehog, and for the delta rule (GDN) the solution of the
    unit lower-triangular system u_i + β_i Σ_{j<i} (Σ_d k_id k_jd e^{G_id − G_jd}) u_j
    = β_i (v_i − (k_i ⊙ e^{G_i})ᵀ S_0) (the WY form of kernels/gdn.py).
    """
    B, T, H, Dk = q.shape
    log_decay = log_decay_per_channel(kind, k, gates)
    delta = kind in ("gdn", "gdn_scalar")
    beta = gates[1] if delta else None

    n = -(-T // chunk)
    pad = n * chunk - T  # padded tokens: k = 0, v = 0, log α = 0, β = 0 change neither o nor S
    to_chunks = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)).transpose(1, 2).reshape(
        B, H, n, chunk, *x.shape[3:])
    q, k, v, log_decay = map(to_chunks, (q, k, v, log_decay))
    if delta:
        beta = F.pad(beta, (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, n, chunk)
    G = log_decay.cumsum(dim=3)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for c in range(n):
        qc, kc, vc, Gc = q[:, :, c], k[:, :, c], v[:, :, c], G[:, :, c]
        span = (Gc[:, :, :, None, :] - Gc[:, :, None, :, :]).masked_fill(~causal[:, :, None], -math.inf)
        pair_decay = span.exp()  # [B,H,i,j,Dk] = e^{G_i − G_j} for j ≤ i, else 0
        qk = torch.einsum("bhid,bhijd,bhjd->bhij", qc, pair_decay, kc)
        gamma = Gc.exp()
        if delta:
            kk = torch.einsum("bhid,bhijd,bhjd->bhij", kc, pair_decay, kc).tril(-1)
            system = torch.eye(chunk, device=q.device) + beta[:, :, c, :, None] * kk
            rhs = beta[:, :, c, :, None] * (vc - (kc * gamma) @ S)
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        else:
            u = vc
        outs.append(scale * ((qc * gamma) @ S + qk @ u))
        last = Gc[:, :, -1:]
        S = last.exp().transpose(-1, -2) * S + (kc * (last - Gc).exp()).transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, H, n * chunk, -1).transpose(1, 2)
    return o[:, :T], S


@functools.lru_cache(maxsize=None)
def fla_kernels():
    """FLA's chunk kernels by the name `fla_linear` uses, or None (no CUDA, or `fla` does not import)."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.kda import chunk_kda
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception:  # not installed, or triton cannot start: the PyTorch forms run instead
        return None
    return {"gla": chunk_gla, "kda": chunk_kda, "gated_delta_rule": chunk_gated_delta_rule,
            "linear_attn": chunk_linear_attn}


def fla_linear(kind: str, q, k, v, gates, scale: float, initial_state=None, kernels=None):
    """`chunked_linear` on flash-linear-attention's chunk kernels: same arguments, same (o, final state).

    FLA (fla-core 0.6) shares this file's conventions: [B,T,H,D] tensors, log-space gates
    (natural log; the kernels rescale to base 2 themselves), β after the sigmoid, a
    [B,H,Dk,Dv] fp32 state with the key axis first, `scale` multiplying q. k and v come
    already on the H query heads, so no GQA/GVA option is used. The mapping is which kernel:
        gla, kgla   chunk_gla(g = log decay per channel; kGLA's key gate folded in first)
        gdn         chunk_kda(g = log α per channel, beta)   KDA is the per-channel gated delta rule
        gdn_scalar  chunk_gated_delta_rule(g = log α per head, beta)
        hedgehog    chunk_linear_attn(normalize=False), scale 1 (the normaliser is v's last column)
    `kernels`: {"gla", "kda", "gated_delta_rule", "linear_attn"} → function (default `fla_kernels()`;
    the tests pass FLA's naive references, which take the same keyword arguments).
    """
    kernels = kernels or fla_kernels()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    state = {"scale": scale, "initial_state": initial_state, "output_final_state": True}
    if kind in ("gla", "kgla"):
        return kernels["gla"](q, k, v, g=log_decay_per_channel(kind, k, gates).contiguous(), **state)
    if kind == "gdn":
        return kernels["kda"](q, k, v, g=gates[0].contiguous(), beta=gates[1].contiguous(), **state)
    if kind == "gdn_scalar":
        return kernels["gated_delta_rule"](q, k, v, g=gates[0].contiguous(), beta=gates[1].contiguous(), **state)
    return kernels["linear_attn"](q, k, v, normalize=False, **state)


def run_linear(form: str, kind: str, q, k, v, gates, scale: float, initial_state=None):
    """The one place a linear kernel is chosen. form "auto": one token → `linear_recurrence` (a decode
    step), CUDA with FLA → `fla_linear`, else `chunked_linear`; "chunked", "recurrent", "fla" force one."""
    if form == "auto":
        if q.shape[1] == 1:
            form = "recurrent"
        elif q.is_cuda and fla_kernels() is not None:
            form = "fla"
        else:
            form = "chunked"
    run = {"chunked": chunked_linear, "recurrent": linear_recurrence, "fla": fla_linear}.get(form)
    if run is None:
        raise ValueError(f"unknown linear form {form!r}; expected auto, chunked, recurrent or fla")
    return run(kind, q, k, v, gates, scale, initial_state)


class LinearAttention(Attention):
    """A linear mixer on the pretrained projections (linjax/mixers/linear.py)."""

    def __init__(self, config: LinjaxConfig, kind: str):
        super().__init__(config)
        settings = config.linearize
        self.kind = kind
        self.form = "auto"  # see `run_linear`
        self.window, self.sinks = int(settings.get("window", 0)), int(settings.get("sinks", 0))
        self.combine = settings.get("combine", "sum")
        d, H, hd = config.hidden_size, self.num_heads, self.head_dim
        scale = settings.get("scale")
        self.scale = float(scale) if scale is not None else (1.0 if kind == "hedgehog" else hd ** -0.5)
        self.output_gain = nn.Parameter(torch.ones(H)) if settings.get("output_gain") else None
        if kind in ("gla", "kgla", "gdn"):  # low-rank per-channel gate: LogSigmoid(h W1 W2 + b)
            rank = int(settings.get("gate_rank", 16))
            self.gate_down = nn.Linear(d, rank, bias=False)
            self.gate_up = nn.Linear(rank, H * hd)
        if kind == "gdn_scalar":
            self.gate_proj = nn.Linear(d, H)
        if kind in ("kgla", "gdn", "gdn_scalar"):
            self.beta_proj = nn.Linear(d, H)
        if kind == "hedgehog":
            self.query_map, self.key_map = FeatureMap(hd), FeatureMap(hd)
        self.conv = settings.get("adapter") == "shortconv"
        if self.conv:
            K = int(settings.get("conv_kernel", 8))
            conv = lambda c: nn.Conv1d(c, c, K, groups=c, bias=True)
            self.q_conv, self.k_conv, self.v_conv = (
                conv(H * hd), conv(self.num_kv_heads * hd), conv(self.num_kv_heads * hd))

    def gates(self, h):
        b, t, _ = h.shape
        h = h.float()
        gates = []
        if self.kind in ("gla", "kgla", "gdn"):
            gates.append(F.logsigmoid(self.gate_up(self.gate_down(h))).view(b, t, self.num_heads, self.head_dim))
        if self.kind == "gdn_scalar":
            gates.append(F.logsigmoid(self.gate_proj(h)))
        if self.kind in ("kgla", "gdn", "gdn_scalar"):
            gates.append(torch.sigmoid(self.beta_proj(h)))
        return gates

    def forward(self, x, position_ids, start: int = 0, cache: Optional[LinearLayerCache] = None):
        """x [B,T,d] at positions start .. start + T − 1; `cache` is read and advanced past them."""
        q, k, v = self.qkv(x, position_ids)
        softmax_q, softmax_k, softmax_v = q, k, v  # the window attends with the raw post-RoPE q, k, v
        if self.conv:
            history = (cache.conv if cache is not None else None) or {}
            (q, hq), (k, hk), (v, hv) = (causal_conv(q, self.q_conv, history.get("q")),
                                         causal_conv(k, self.k_conv, history.get("k")),
                                         causal_conv(v, self.v_conv, history.get("v")))
            if cache is not None:
                cache.conv = {"q": hq, "k": hk, "v": hv}
        if self.kind == "hedgehog":
            q, k = self.query_map(q), self.key_map(k)
            v = torch.cat([v.float(), torch.ones_like(v[..., :1], dtype=torch.float32)], dim=-1)  # [v, 1]
        else:
            q, k = l2_normalize(q), l2_normalize(k)
        linear_inputs = [k.float(), v.float(), *self.gates(x)]
        if self.window:
            linear_inputs, shifted = shift_linear_inputs(linear_inputs, self.sinks, self.window, start,
                                                         None if cache is None else cache.shifted)
            if cache is not None:
                cache.shifted = shifted
        k, v, *gates = linear_inputs
        H = self.num_heads
        lin, state = run_linear(self.form, self.kind, q.float(), expand_kv(k, H), expand_kv(v, H), gates, self.scale,
                                None if cache is None else cache.recurrent)
        if cache is not None:
            cache.recurrent = state
        normaliser = None
        if self.kind == "hedgehog":
            lin, normaliser = lin[..., :-1], lin[..., -1]
        if self.output_gain is not None:  # linjax/mixers/linear.py `_apply_gain`
            lin = lin * self.output_gain[:, None]
            if normaliser is not None and self.window and self.combine == "sum":
                normaliser = normaliser * self.output_gain
        if self.window:
            positions = token_positions(start, x.shape[1], x.device)
            keys, values, key_positions = ((softmax_k, softmax_v, positions) if cache is None
                                           else cache.window.extend(softmax_k, softmax_v, positions))
            numerator, _, row_sum = window_softmax_parts(softmax_q, keys, values, positions, key_positions,
                                                         self.sinks, self.window)
            y = self.combine_parts(lin, normaliser, numerator, row_sum)
        elif normaliser is not None:
            y = lin / (normaliser[..., None] + 1e-10)
        else:
            y = lin
        return self.out(y.to(x.dtype))

    def combine_parts(self, lin, normaliser, numerator, row_sum):
        """linjax/mixers/linear.py `_combine`: one shared normaliser for Hedgehog with combine="sum"."""
        if normaliser is not None and self.combine == "sum":
            return (numerator + lin) / (row_sum + normaliser)[..., None]
        if normaliser is not None:
            lin = lin / (normaliser[..., None] + 1e-10)
        window_out = numerator / row_sum[..., None]
        if self.combine == "mixed":  # Liger: 0.5 · linear + 0.5 · window
            return 0.5 * lin + 0.5 * window_out
        return lin + window_out


# ----------------------------------------------------------------------------- model


class DecoderLayer(nn.Module):
    def __init__(self, config: LinjaxConfig, mixer: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if mixer in ("softmax", "window"):
            self.self_attn = Attention(config) if mixer == "softmax" else WindowAttention(config)
        else:
            self.self_attn = LinearAttention(config, mixer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, position_ids, start: int = 0, cache: Optional[LayerCache] = None):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LinjaxModel(nn.Module):
    def __init__(self, config: LinjaxConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, m) for m in config.mixers])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, position_ids, cache: Optional[LinjaxCache] = None):
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
