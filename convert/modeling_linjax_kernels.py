"""The PyTorch mirror's math, free of any mechanism: RoPE, softmax over sinks + window, short conv,
the shifted linear inputs, and one gated (delta-rule) linear recurrence in three forms.

modeling_linjax.py imports this file relatively, so transformers' remote-code loader copies
it into the export directory beside it. Every linear mechanism (modeling_linjax_linear.py)
reduces to the one recurrence here, per query head, with the state S_t including token t:

    plain      S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ
    delta rule S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ      (paper, sec. 3.2)
    o_t = scale · S_tᵀ q_t

given as log α_t per key channel [B,T,H,Dk] and β_t [B,T,H] (None: the plain form). The forms:
`recurrent_form` (token by token, the reference and the decode step), `chunked_form` (16 tokens
at a time) and FLA's chunk kernels (`fla_kernels`, CUDA only). Imports only torch.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

MASKED = -1e30  # the window softmax's finite "−inf" (kernels/swa.py)


# ----------------------------------------------------------------------------- RoPE


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


# ----------------------------------------------------------------------------- softmax over sinks + window


def expand_kv(x, heads: int):
    """[B,T,Hkv,D] → [B,T,H,D]: query head h reads kv head h // (H // Hkv)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def token_positions(start: int, length: int, device) -> torch.Tensor:
    """Positions start .. start + length − 1 of the tokens in this call (the masks and the shift use them)."""
    return torch.arange(start, start + length, device=device)


def window_softmax_parts(q, k, v, query_positions, key_positions, sinks: int, window: int | None):
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
    scores = scores.masked_fill(~mask, MASKED)
    row_max = scores.amax(-1)
    p = torch.exp(scores - row_max[..., None]) * mask
    numerator = torch.einsum("bhtj,bjhe->bthe", p, v)
    return numerator, row_max.transpose(1, 2), p.sum(-1).transpose(1, 2)


# ----------------------------------------------------------------------------- the linear inputs


def l2_normalize(x, eps: float = 1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(x, conv: torch.nn.Conv1d, history=None):
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


# ----------------------------------------------------------------------------- the linear recurrence


def recurrent_form(q, k, v, log_decay, beta, scale: float, initial_state=None):
    """(o [B,T,H,Dv], final state [B,H,Dk,Dv]) of the recurrence, token by token (fp32).

    q, k [B,T,H,Dk] and v [B,T,H,Dv] on the H query heads; log_decay [B,T,H,Dk]; beta [B,T,H]
    for the delta rule, None for the plain form; initial_state: S before the first token (None: zeros).
    """
    B, T, H, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]
        S = torch.exp(log_decay[:, t])[..., None] * S
        if beta is None:
            S = S + kt[..., :, None] * vt[..., None, :]
        else:
            err = vt - torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + kt[..., :, None] * (beta[:, t, :, None] * err)[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(outs, dim=1), S


def chunked_form(q, k, v, log_decay, beta, scale: float, initial_state=None, chunk: int = 16):
    """`recurrent_form`'s (o, final state) computed a chunk at a time (same arguments; fp32).

    Inside a chunk, with G_i = Σ_{t≤i} log α_t (per channel, from the chunk start) and S_0 the
    state before it, every exponent below is a sum of log-gates over the span it decays, so ≤ 0:
        o_i = scale · [(q_i ⊙ e^{G_i})ᵀ S_0 + Σ_{j≤i} (Σ_d q_id k_jd e^{G_id − G_jd}) u_j]
        S_C = Diag(e^{G_C}) S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) u_jᵀ
    with u_j = v_j for the plain form, and for the delta rule the solution of the unit
    lower-triangular system u_i + β_i Σ_{j<i} (Σ_d k_id k_jd e^{G_id − G_jd}) u_j
    = β_i (v_i − (k_i ⊙ e^{G_i})ᵀ S_0) (the WY form of kernels/gdn.py).
    """
    B, T, H, Dk = q.shape
    delta = beta is not None
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


@functools.cache
def fla_kernels():
    """FLA's chunk kernels by the names the mechanisms' `fla_kernel` use, or None (no CUDA, or `fla` does
    not import)."""
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


def fla_form(kernel, q, k, v, scale: float, initial_state=None, **arguments):
    """One of FLA's chunk kernels (fla-core 0.6) with this file's conventions, which FLA shares:
    [B,T,H,D] tensors, log-space gates (natural log; the kernels rescale to base 2 themselves),
    β after the sigmoid, a [B,H,Dk,Dv] fp32 state with the key axis first, `scale` multiplying q.
    k and v come already on the H query heads, so no GQA/GVA option is used. `arguments`: the
    mechanism's gates as the kernel names them (g, beta) and options (normalize)."""
    arguments = {name: x.contiguous() if torch.is_tensor(x) else x for name, x in arguments.items()}
    return kernel(q.contiguous(), k.contiguous(), v.contiguous(), scale=scale, initial_state=initial_state,
                  output_final_state=True, **arguments)


FORMS = ("auto", "chunked", "recurrent", "fla")


def resolve_form(form: str, q) -> str:
    """form "auto": one token → "recurrent" (a decode step), CUDA with FLA → "fla", else "chunked";
    "chunked", "recurrent" and "fla" are kept as asked."""
    if form not in FORMS:
        raise ValueError(f"unknown linear form {form!r}; expected auto, chunked, recurrent or fla")
    if form != "auto":
        return form
    if q.shape[1] == 1:
        return "recurrent"
    return "fla" if q.is_cuda and fla_kernels() is not None else "chunked"
