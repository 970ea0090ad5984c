"""A linearized linjax model in plain PyTorch, for `transformers` with `trust_remote_code=True`.

linjax's export (convert/export.py) copies this file next to config.json and
model.safetensors, so the directory loads without JAX:

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

It reproduces linjax's forward pass in fp32 (the parity test holds it to 1e-4
max abs on the logits). What it does differently from HF's LlamaForCausalLM:
- each layer's mixer is either the pretrained softmax attention or a linear
  one (config.mixers[i]: gla, kgla, gdn, gdn_scalar, hedgehog), optionally
  beside exact softmax over `sinks` first tokens and a `window` of recent ones,
  the linear state then covering only positions sinks .. t − window (paper, sec. 4);
- the short-conv adapter runs on q, k, v after RoPE; a LoRA adapter is already
  merged into the q/k/v/o weights by the exporter (exact: the mixer applies it
  to both the softmax and the linear part);
- the linear recurrences run a chunk of 16 tokens at a time (`chunked_linear`;
  `linear_recurrence` is the token-by-token reference, kept for checking);
  the window softmax uses a dense [T, T] mask; there is no KV / state cache, so
  `generate` recomputes the whole prefix every step (exact, quadratic in the
  generated length).

Kernel math (linjax/kernels/*.py), per query head h reading kv head h // (H // Hkv),
state S_t including token t, o_t = scale · S_tᵀ q_t, scale = Dk^-1/2:
    GLA        S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ
    kGLA       GLA with the decay α_t ⊙ max(1 − β_t k_t², 1e-6)
    GDN        S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ   (α per channel)
    gdn_scalar the same with one α per head
    Hedgehog   S_t = Σ φ(k_i)[v_i, 1]ᵀ, scale 1, normalised by the last column
Imports only torch, transformers, math and typing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

LINEAR_MIXERS = ("gla", "kgla", "gdn", "gdn_scalar", "hedgehog")
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
        unknown = sorted(set(self.mixers) - set(LINEAR_MIXERS) - {"softmax"})
        if unknown:
            raise ValueError(f"unknown mixers {unknown}; this file implements softmax and {list(LINEAR_MIXERS)}")


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


def window_softmax_parts(q, k, v, sinks: int, window: Optional[int]):
    """Unnormalised softmax over I_t = {j ≤ t : j < sinks or t − j < window} (window None: all j ≤ t).

    Dense [T, T] scores: fine for export checks and short prompts. Returns fp32
    (numerator [B,T,H,Dv], row_max [B,T,H], row_sum [B,T,H]) as kernels/swa.py's SoftmaxParts.
    """
    H, D, T = q.shape[2], q.shape[3], q.shape[1]
    k, v = expand_kv(k.float(), H), expand_kv(v.float(), H)
    scores = torch.einsum("bthd,bjhd->bhtj", q.float(), k) * D ** -0.5
    t = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    mask = j <= t
    if window is not None:
        mask = mask & ((j < sinks) | (t - j < window))
    scores = scores.masked_fill(~mask, _MASKED)
    row_max = scores.amax(-1)
    p = torch.exp(scores - row_max[..., None]) * mask
    numerator = torch.einsum("bhtj,bjhe->bthe", p, v)
    return numerator, row_max.transpose(1, 2), p.sum(-1).transpose(1, 2)


class Attention(nn.Module):
    """The pretrained q/k/v/o projections (with q/k norm and RoPE), and full causal softmax attention."""

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

    def forward(self, x, positions):
        q, k, v = self.qkv(x, positions)
        numerator, _, row_sum = window_softmax_parts(q, k, v, 0, None)
        return self.out((numerator / row_sum[..., None]).to(x.dtype))


# ----------------------------------------------------------------------------- linear mixers


class FeatureMap(nn.Module):
    """Hedgehog's φ(x) = softmax(xW + b) ⊕ softmax(−(xW + b)), shared by the heads."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.proj = nn.Linear(head_dim, head_dim)

    def forward(self, x):
        z = self.proj(x.float())
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)


def l2_normalize(x, eps: float = 1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(x, conv: nn.Conv1d):
    """Depthwise causal conv over time: x [B,T,N,D] → same shape (left padding K − 1, fp32)."""
    b, t, n, d = x.shape
    y = conv(F.pad(x.float().reshape(b, t, n * d).transpose(1, 2), (conv.kernel_size[0] - 1, 0)))
    return y.transpose(1, 2).reshape(b, t, n, d)


def shift_linear_inputs(k, v, gates, sinks: int, window: int):
    """Entry t gets the token at t − window (zeros before), its key zeroed if it is a sink:
    the linear state at t is then S over positions sinks .. t − window (kernels/swa.py)."""
    T = k.shape[1]

    def shift(x):
        pad = torch.zeros((x.shape[0], window) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        return torch.cat([pad, x], dim=1)[:, :T]

    source = torch.arange(T, device=k.device) - window
    keep = (source >= sinks).to(k.dtype).view(1, T, *([1] * (k.dim() - 2)))
    return shift(k) * keep, shift(v), [shift(g) for g in gates]


def linear_recurrence(kind: str, q, k, v, gates, scale: float):
    """o [B,T,H,Dv] (fp32) of the mechanism's recurrence, token by token; q [B,T,H,Dk], k, v on H heads."""
    B, T, H, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
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
    return torch.stack(outs, dim=1)


def chunked_linear(kind: str, q, k, v, gates, scale: float, chunk: int = 16):
    """`linear_recurrence`'s output computed a chunk at a time (same arguments; fp32).

    Inside a chunk, with G_i = Σ_{t≤i} log α_t (per channel, from the chunk start) and S_0 the
    state before it, every exponent below is a sum of log-gates over the span it decays, so ≤ 0:
        o_i = scale · [(q_i ⊙ e^{G_i})ᵀ S_0 + Σ_{j≤i} (Σ_d q_id k_jd e^{G_id − G_jd}) u_j]
        S_C = Diag(e^{G_C}) S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) u_jᵀ
    with u_j = v_j for GLA / kGLA / Hedgehog, and for the delta rule (GDN) the solution of the
    unit lower-triangular system u_i + β_i Σ_{j<i} (Σ_d k_id k_jd e^{G_id − G_jd}) u_j
    = β_i (v_i − (k_i ⊙ e^{G_i})ᵀ S_0) (the WY form of kernels/gdn.py).
    """
    B, T, H, Dk = q.shape
    if kind in ("gla", "kgla", "gdn"):
        log_decay = gates[0]
    elif kind == "gdn_scalar":
        log_decay = gates[0][..., None].expand(B, T, H, Dk)
    else:  # hedgehog
        log_decay = torch.zeros_like(q)
    if kind == "kgla":  # kernels/kgla.py key_log_gate
        erase = gates[1][..., None] * k * k
        log_decay = log_decay + torch.log1p(-torch.clamp(erase, max=1.0 - KEY_GATE_FLOOR))
    delta = kind in ("gdn", "gdn_scalar")
    beta = gates[1] if delta else None

    n = -(-T // chunk)
    pad = n * chunk - T  # padded tokens: k = 0, v = 0, log α = 0, β = 0 change nothing before them
    to_chunks = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)).transpose(1, 2).reshape(
        B, H, n, chunk, *x.shape[3:])
    q, k, v, log_decay = map(to_chunks, (q, k, v, log_decay))
    if delta:
        beta = F.pad(beta, (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, n, chunk)
    G = log_decay.cumsum(dim=3)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    S = q.new_zeros(B, H, Dk, v.shape[-1])
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
    return o[:, :T]


class LinearAttention(Attention):
    """A linear mixer on the pretrained projections (linjax/mixers/linear.py)."""

    def __init__(self, config: LinjaxConfig, kind: str):
        super().__init__(config)
        settings = config.linearize
        self.kind = kind
        self.form = "chunked"  # or "recurrent": `linear_recurrence`, token by token (the reference)
        self.window, self.sinks = int(settings.get("window", 0)), int(settings.get("sinks", 0))
        self.combine = settings.get("combine", "sum")
        d, H, hd = config.hidden_size, self.num_heads, self.head_dim
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

    def forward(self, x, positions):
        q, k, v = self.qkv(x, positions)
        softmax_q, softmax_k, softmax_v = q, k, v  # the window attends with the raw post-RoPE q, k, v
        if self.conv:
            q, k, v = causal_conv(q, self.q_conv), causal_conv(k, self.k_conv), causal_conv(v, self.v_conv)
        if self.kind == "hedgehog":
            q, k = self.query_map(q), self.key_map(k)
            v = torch.cat([v.float(), torch.ones_like(v[..., :1], dtype=torch.float32)], dim=-1)  # [v, 1]
        else:
            q, k = l2_normalize(q), l2_normalize(k)
        gates = self.gates(x)
        k, v = k.float(), v.float()
        if self.window:
            k, v, gates = shift_linear_inputs(k, v, gates, self.sinks, self.window)
        H = self.num_heads
        scale = 1.0 if self.kind == "hedgehog" else self.head_dim ** -0.5
        run = chunked_linear if self.form == "chunked" else linear_recurrence
        lin = run(self.kind, q.float(), expand_kv(k, H), expand_kv(v, H), gates, scale)
        normaliser = None
        if self.kind == "hedgehog":
            lin, normaliser = lin[..., :-1], lin[..., -1]
        if self.window:
            numerator, _, row_sum = window_softmax_parts(softmax_q, softmax_k, softmax_v, self.sinks, self.window)
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
        self.self_attn = Attention(config) if mixer == "softmax" else LinearAttention(config, mixer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class LinjaxModel(nn.Module):
    def __init__(self, config: LinjaxConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, m) for m in config.mixers])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class LinjaxPreTrainedModel(PreTrainedModel):
    config_class = LinjaxConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        # Every tensor comes from the checkpoint; nothing to initialise.
        pass


class LinjaxForCausalLM(LinjaxPreTrainedModel, GenerationMixin):
    """Tokens [B,T] → logits [B,T,vocab]; no cache: `generate` recomputes the prefix each step."""

    def __init__(self, config: LinjaxConfig):
        super().__init__(config)
        self.model = LinjaxModel(config)
        # Tied embeddings reuse embed_tokens in forward instead of a second (tied) module.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                past_key_values=None, use_cache=None, return_dict=None, **kwargs):
        if input_ids is None:
            raise ValueError("LinjaxForCausalLM needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padding is not supported (the linear state has no mask): pass unpadded "
                             "rows of equal length, or one row at a time")
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.model(input_ids, position_ids)
        logits = F.linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No cache: always the whole sequence so far (exact; costs a full forward per token).
        return {"input_ids": input_ids, "attention_mask": attention_mask}
