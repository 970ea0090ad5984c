"""The linear mechanisms of the PyTorch mirror: one class per mechanism (linjax/mixers/*.py).

`LinearAttention` is what every linear mixer shares (linjax/mixers/linear.py): the pretrained
projections, the short conv, exact softmax over the sinks and the window beside the linear
state over positions sinks .. t − window (paper, sec. 4), the per-head output gain and the
combination of the two parts. A mechanism's class adds its new parameters (under the names
linjax's export writes: each JAX mixer's `torch_tensors`) and says, as methods:

    gates(h)                 its gate tensors from the block input
    features(q, k, v)        what the kernel reads (L2-normalised q, k; Hedgehog's feature maps)
    decay_and_beta(k, gates) its recurrence as log α per key channel and β (None: no delta rule)
    fla_kernel, fla_arguments(k, gates)   the FLA chunk kernel that computes it, and its arguments
    split_normaliser(o)      Hedgehog's normaliser, carried as v's last column

Per query head h reading kv head h // (H // Hkv), o_t = scale · S_tᵀ q_t, scale = the config's
`linearize.scale`, or where that is null or absent (FLA's default, linjax's before it moved to 1)
Dk^-1/2 (1 for Hedgehog).

With `linearize.retain` > 0 (docs/retention.md) the mixer also keeps retained tokens beside the sinks and
the window (modeling_linjax_retention.py) and runs the recurrence one token at a time
(`forward_retaining`), whatever `form` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_linjax_attention import MIXERS, Attention, sinks_and_window
from .modeling_linjax_cache import LinearLayerCache, RetainedSlots
from .modeling_linjax_kernels import (
    apply_rope,
    causal_conv,
    chunked_form,
    expand_kv,
    fla_form,
    fla_kernels,
    l2_normalize,
    recurrent_form,
    resolve_form,
    rope_inverse_frequencies,
    shift_linear_inputs,
    token_positions,
    window_softmax_parts,
)
from .modeling_linjax_retention import SCORES as RETAIN_SCORES
from .modeling_linjax_retention import admit as admit_retained
from .modeling_linjax_retention import attend as attend_retained
from .modeling_linjax_retention import key_norm, recall_error, received_mass
from .modeling_linjax_retention import merge as merge_parts
from .modeling_linjax_retention import select as select_retained

KEY_GATE_FLOOR = 1e-6  # kGLA: 1 − β k² is floored here (kernels/kgla.py)
LIGER_GATE_NORMALIZER = 16.0  # Liger-GLA's gate logit normaliser (linjax/mixers/gla.py)


class LinearAttention(Attention):
    """A linear mixer on the pretrained projections; subclasses are the mechanisms."""

    mechanism = None  # a base class, not a mechanism
    linear_scale = None  # the mechanism's default scale (None: Dk^-1/2, as FLA's kernels)
    fla_kernel = None  # the name of its kernel in `fla_kernels()`
    normalized = False  # True for normalised linear attention (Hedgehog): v is [v, 1], the state's last column

    def __init__(self, config):
        super().__init__(config)
        settings = config.linearize
        self.form = "auto"  # which form of the recurrence runs: see modeling_linjax_kernels.resolve_form
        self.sinks, self.window = sinks_and_window(settings)
        self.retain, self.retain_score = int(settings.get("retain", 0)), settings.get("retain_score", "recall")
        self.retain_block = int(settings.get("retain_block", 1))
        if self.retain_block > 1 and not (self.retain and self.retain_block <= self.window):
            raise ValueError(f"linearize.retain_block={self.retain_block} needs retain > 0 and a window of at least "
                             f"that many tokens (got retain={self.retain}, window={self.window})")
        if self.retain and not self.window:
            raise ValueError(f"linearize.retain={self.retain} keeps tokens as they leave the window; "
                             "it needs window ≥ 1")
        if self.retain_score not in RETAIN_SCORES:
            raise ValueError(f"unknown linearize.retain_score {self.retain_score!r}; expected one of "
                             f"{list(RETAIN_SCORES)}")
        self.combine = settings.get("combine", "sum")
        H, hd = self.num_heads, self.head_dim
        scale = settings.get("scale")
        default = hd ** -0.5 if self.linear_scale is None else self.linear_scale
        self.scale = float(scale) if scale is not None else default
        self.output_gain = nn.Parameter(torch.ones(H)) if settings.get("output_gain") else None
        self.conv = "shortconv" in (settings.get("adapter") or "").split("+")  # LoRA is merged in q/k/v/o
        self.conv_on_window = bool(settings.get("conv_on_window", False))
        # Liger-GLA's form (linjax/mixers/linear.py): q, k of the linear part before RoPE, a state over every token
        self.linear_rope = bool(settings.get("linear_rope", True))
        self.state_covers_window = bool(settings.get("state_covers_window", False))
        if self.conv:
            K = int(settings.get("conv_kernel", 8))
            conv = lambda c: nn.Conv1d(c, c, K, groups=c, bias=True)
            self.q_conv, self.k_conv, self.v_conv = (
                conv(H * hd), conv(self.num_kv_heads * hd), conv(self.num_kv_heads * hd))

    @classmethod
    def new_cache(cls, settings: dict):
        return LinearLayerCache(*sinks_and_window(settings))

    # ---------------------------------------------------------------- per mechanism

    def gates(self, h) -> list:
        """The mechanism's gate tensors [B,T,H,...] from the block input h [B,T,d], in fp32."""
        raise NotImplementedError

    def features(self, q, k, v):
        """q, k, v after RoPE (and short conv) → what the recurrence reads. Default: L2-normalised q and k."""
        return l2_normalize(q), l2_normalize(k), v

    def split_normaliser(self, o):
        """The recurrence's output → (linear output, normaliser [B,T,H] or None)."""
        return o, None

    @staticmethod
    def decay_and_beta(k, gates):
        """(log α [B,T,H,Dk] per key channel, β [B,T,H] or None) of the recurrence (modeling_linjax_kernels)."""
        raise NotImplementedError

    @classmethod
    def fla_arguments(cls, k, gates) -> dict:
        """The gates as `fla_kernel` takes them. Default: g = log α per channel, and β if there is one."""
        log_decay, beta = cls.decay_and_beta(k, gates)
        return {"g": log_decay} if beta is None else {"g": log_decay, "beta": beta}

    # ---------------------------------------------------------------- shared machinery

    @classmethod
    def linear_kernel(cls, form: str, q, k, v, gates, scale: float, initial_state=None, kernels=None):
        """(o [B,T,H,Dv], final state [B,H,Dk,Dv]) of this mechanism's recurrence in `form` (auto, chunked,
        recurrent, fla). q, k, v on the H query heads; `kernels`: FLA's (default `fla_kernels()`)."""
        form = resolve_form(form, q)
        if form == "fla":
            kernel = (kernels or fla_kernels())[cls.fla_kernel]
            return fla_form(kernel, q, k, v, scale, initial_state, **cls.fla_arguments(k, gates))
        log_decay, beta = cls.decay_and_beta(k, gates)
        run = recurrent_form if form == "recurrent" else chunked_form
        return run(q, k, v, log_decay, beta, scale, initial_state)

    def forward(self, x, position_ids, start: int = 0, cache: LinearLayerCache | None = None):
        """x [B,T,d] at positions start .. start + T − 1; `cache` is read and advanced past them."""
        if self.retain_block > 1:
            return self.forward_retaining_blocks(x, position_ids, start, cache)
        if self.retain:
            return self.forward_retaining(x, position_ids, start, cache)
        softmax_q, softmax_k, softmax_v, q, k, v = self.window_and_linear_qkv(x, position_ids, cache)
        if not self.linear_rope:  # rotated back: what the projections gave
            inverse = -rope_inverse_frequencies(self.rope, self.head_dim)
            q, k = apply_rope(q, position_ids, inverse), apply_rope(k, position_ids, inverse)
        q, k, v = self.features(q, k, v)
        linear_inputs = [k.float(), v.float(), *self.gates(x)]
        if self.window and not self.state_covers_window:
            linear_inputs, shifted = shift_linear_inputs(linear_inputs, self.sinks, self.window, start,
                                                         None if cache is None else cache.shifted)
            if cache is not None:
                cache.shifted = shifted
        k, v, *gates = linear_inputs
        H = self.num_heads
        lin, state = self.linear_kernel(self.form, q.float(), expand_kv(k, H), expand_kv(v, H), gates, self.scale,
                                        None if cache is None else cache.recurrent)
        if cache is not None:
            cache.recurrent = state
        parts = None
        if self.window:
            positions = token_positions(start, x.shape[1], x.device)
            keys, values, key_positions = ((softmax_k, softmax_v, positions) if cache is None
                                           else cache.window.extend(softmax_k, softmax_v, positions))
            parts = window_softmax_parts(softmax_q, keys, values, positions, key_positions, self.sinks, self.window)
        return self.output(lin, parts, x.dtype)

    def forward_retaining(self, x, position_ids, start: int = 0, cache: LinearLayerCache | None = None):
        """`forward` with retained tokens (linjax/mixers/linear_retained.py `by_tokens`): projections, short conv,
        features, gates and the sinks + window softmax run over the block, then each token in turn (which
        tokens are retained depends on the state): the token leaving the window is scored and offered a
        slot, the one evicted or refused is written into the state with the leaving token's decay (the
        state decays as without retention; only what it stores changes), and the retained slots join the
        softmax. Always the recurrent form, one token at a time, so a prefill then decode equals the
        whole forward. Without a cache a fresh one is used and dropped. With the "attention" score each
        query's probabilities over its window are added to the window tokens' masses (`window_masses`)."""
        if cache is None:
            cache = LinearLayerCache(self.sinks, self.window)
        softmax_q, softmax_k, softmax_v, q, k, v = self.window_and_linear_qkv(x, position_ids, cache)
        recent_kv = cache.window.latest(self.window, softmax_k[:, :1])
        # The pretrained keys and values of the tokens leaving the window, delayed as the linear inputs are
        # (a sink's key is zeroed there too: sinks are never offered a slot).
        leaving_kv, _ = shift_linear_inputs([softmax_k, softmax_v], self.sinks, self.window, start, recent_kv)
        # "attention": the window's and these tokens' pretrained keys and masses, entry e at position start − w + e
        joined_k = torch.cat([recent_kv[0].to(softmax_k.dtype), softmax_k], dim=1)
        mass = self.window_masses(cache, x)
        q, k, v = self.features(q, k, v)
        leaving, cache.shifted = shift_linear_inputs([k.float(), v.float(), *self.gates(x)], self.sinks,
                                                     self.window, start, cache.shifted)
        positions = token_positions(start, x.shape[1], x.device)
        keys, values, key_positions = cache.window.extend(softmax_k, softmax_v, positions)
        window_parts = window_softmax_parts(softmax_q, keys, values, positions, key_positions, self.sinks,
                                            self.window)
        H = self.num_heads
        state = cache.recurrent
        if state is None:
            state = q.new_zeros(q.shape[0], H, q.shape[-1], leaving[1].shape[-1], dtype=torch.float32)
        outputs, parts = [], []
        for i, t in enumerate(positions.tolist()):
            token = [a[:, i] for a in leaving]  # the leaving token's (k', v', *gates) [B, heads, ...]
            written = token  # with its key zeroed when no token leaves or it is a sink
            if t - self.window >= self.sinks:  # entry i of `mass`: position t − w, which leaves now
                written = self.retain_step(cache, [a[:, i] for a in leaving_kv], token, state, t,
                                           None if mass is None else mass[:, i])
            wk, wv, *wgates = (a[:, None] for a in written)
            out, state = self.linear_kernel("recurrent", q[:, i:i + 1].float(), expand_kv(wk, H), expand_kv(wv, H),
                                            wgates, self.scale, state)
            outputs.append(out)
            step_parts = tuple(part[:, i] for part in window_parts)
            if cache.retained is not None:
                step_parts = merge_parts(step_parts, attend_retained(softmax_q[:, i], cache.retained))
            parts.append(step_parts)
            if mass is not None:  # the window: positions t − w + 1 .. t, entries i + 1 .. i + w
                seen = slice(i + 1, i + 1 + self.window)
                key_position = torch.arange(t - self.window + 1, t + 1, device=x.device)
                mass[:, seen] += received_mass(softmax_q[:, i], joined_k[:, seen], key_position >= self.sinks,
                                               step_parts[1], step_parts[2])
        if mass is not None:
            cache.mass = mass[:, -self.window:]
        cache.recurrent = state
        parts = tuple(torch.stack(part, dim=1) for part in zip(*parts))
        return self.output(torch.cat(outputs, dim=1), parts, x.dtype)

    def forward_retaining_blocks(self, x, position_ids, start: int = 0, cache: LinearLayerCache | None = None):
        """`forward` with retained tokens chosen a block of C = `retain_block` at a time (linjax's
        linjax/mixers/linear_retained.py `by_blocks`), one token at a time: at a position that is a multiple of C
        the C tokens t − w .. t − w + C − 1 leave the block-aligned window together, compete with the
        retained ones (`select`), and the losers are written into the state one per step with the leaving
        tokens' decays; every query of the block then reads the same state and attends to the sinks, the
        retained tokens and the positions from (t // C + 1)·C − w on. With the "attention" score each query's
        probabilities over that window are added to its tokens' masses (`window_masses`), read at the
        boundary where a token leaves, scaled to w queries (linjax's SinksWindow.leaving_mass)."""
        if cache is None:
            cache = LinearLayerCache(self.sinks, self.window)
        softmax_q, softmax_k, softmax_v, q, k, v = self.window_and_linear_qkv(x, position_ids, cache)
        W, C, H = self.window, self.retain_block, self.num_heads
        # the pretrained k, v and the linear inputs of the window's tokens and these, oldest first
        recent_kv = cache.window.latest(W, softmax_k[:, :1])
        joined_kv = [torch.cat([old.to(new.dtype), new], dim=1) for old, new in zip(recent_kv, (softmax_k, softmax_v))]
        q, k, v = self.features(q, k, v)
        inputs = [k.float(), v.float(), *self.gates(x)]
        history = cache.shifted or [a.new_zeros((a.shape[0], W) + tuple(a.shape[2:])) for a in inputs]
        joined = [torch.cat([old, new], dim=1) for old, new in zip(history, inputs)]
        cache.shifted = [a[:, -W:] for a in joined]
        mass = self.window_masses(cache, x)  # entry e: position start − W + e, as in the joined arrays
        positions = token_positions(start, x.shape[1], x.device)
        keys, values, key_positions = cache.window.extend(softmax_k, softmax_v, positions)
        state = cache.recurrent
        if state is None:
            state = q.new_zeros(q.shape[0], H, q.shape[-1], inputs[1].shape[-1], dtype=torch.float32)
        outputs, parts = [], []
        for i, t in enumerate(positions.tolist()):
            if t % C == 0:
                leaving = slice(i, i + C)  # positions t − W .. t − W + C − 1 in the joined arrays
                # the i-th of them was seen by W − i queries (t − W + i .. t − 1): scaled to W
                scaled = None if mass is None else mass[:, leaving] * (W / (W - torch.arange(C, device=x.device)))[
                    None, :, None]
                state = self.block_boundary(cache, [a[:, leaving] for a in joined_kv],
                                            [a[:, leaving] for a in joined], state, t - W, scaled)
            outputs.append(self.scale * torch.einsum("bhd,bhde->bhe", q[:, i].float(), state)[:, None])
            first = (t // C + 1) * C - W
            step = window_softmax_parts(softmax_q[:, i:i + 1], keys, values, positions[i:i + 1], key_positions,
                                        self.sinks, t - first + 1)
            parts.append(merge_parts(tuple(part[:, 0] for part in step), attend_retained(softmax_q[:, i],
                                                                                         cache.retained)))
            if mass is not None:  # the block-aligned window: positions first .. t
                seen = slice(first - start + W, i + W + 1)
                key_position = torch.arange(first, t + 1, device=x.device)
                mass[:, seen] += received_mass(softmax_q[:, i], joined_kv[0][:, seen], key_position >= self.sinks,
                                               parts[-1][1], parts[-1][2])
        if mass is not None:
            cache.mass = mass[:, -W:]
        cache.recurrent = state
        parts = tuple(torch.stack(part, dim=1) for part in zip(*parts))
        return self.output(torch.cat(outputs, dim=1), parts, x.dtype)

    def block_boundary(self, cache: LinearLayerCache, leaving_kv: list, leaving: list, state, first: int,
                       mass=None):
        """The C tokens leaving at a block boundary (positions first .. first + C − 1; pretrained k, v and
        linear inputs [B, C, ...]) against the retained slots; returns the state after the losers are
        written, one per step with the leaving tokens' decays. `mass`: their "attention" scores [B, C, Hkv]."""
        C = leaving[0].shape[1]
        decay = leaving[2] if len(leaving) > 2 else None
        travelling = leaving[:2] + leaving[3:]
        if cache.retained is None:
            cache.retained = RetainedSlots(self.retain, [a[:, 0] for a in leaving_kv + travelling])
        slots = cache.retained
        if self.retain_score == "key_norm":
            score = key_norm(leaving_kv[0])
        elif self.retain_score == "attention":  # fixed in a slot: the held tokens keep theirs
            score = mass
        else:  # against the state after the block's decay, the held tokens re-scored too
            total = None if decay is None else decay.sum(dim=1)
            recall = lambda k, v: recall_error(state, k, v, total, normalized=self.normalized)
            score = recall(leaving[0], leaving[1])
            slots.score = torch.where(slots.position >= 0, recall(slots.linear[0], slots.linear[1]), -torch.inf)
        position = torch.arange(first, first + C, device=score.device)
        valid = (position >= max(self.sinks, 0))[None, :, None].expand_as(score)
        (k, v, *gates), written_valid = select_retained(slots, leaving_kv + travelling, score,
                                                        position[None, :, None].expand_as(score), valid)
        k = torch.where(written_valid[..., None], k, torch.zeros_like(k))
        gates = ([decay] if decay is not None else []) + gates
        H = self.num_heads
        no_query = k.new_zeros(k.shape[0], C, H, k.shape[-1])
        _, state = self.linear_kernel("recurrent", no_query, expand_kv(k, H), expand_kv(v, H), gates, self.scale, state)
        return state

    def retain_step(self, cache: LinearLayerCache, leaving_kv: list, token: list, state, position: int,
                    mass=None) -> list:
        """Offers the token leaving the window at this step (pretrained k, v [B,Hkv,D], linear inputs
        `token`) to the retained slots, scored against `state` (S before this step), or by the softmax mass
        it received in the window (`mass` [B,Hkv], the "attention" score); returns the linear
        inputs written into the state: the evicted or refused token's, the leaving token's decay, and a
        zero key where a free slot took the token and nothing is written."""
        decay = token[2] if len(token) > 2 else None
        travelling = token[:2] + token[3:]  # the decay stays with the step (linjax's `decay_inputs`)
        if cache.retained is None:
            cache.retained = RetainedSlots(self.retain, leaving_kv + travelling)
        slots = cache.retained
        if self.retain_score == "key_norm":
            score = key_norm(leaving_kv[0])
        elif self.retain_score == "attention":  # fixed in a slot: the held tokens keep theirs
            score = mass
        else:  # re-scored every step against the state it would enter now (docs/retention.md, "Scores")
            recall = lambda k, v: recall_error(state, k, v, decay, normalized=self.normalized)
            score = recall(token[0][:, None], token[1][:, None])[:, 0]
            slots.score = torch.where(slots.position >= 0, recall(slots.linear[0], slots.linear[1]), -torch.inf)
        (k, v, *gates), written_valid = admit_retained(slots, leaving_kv + travelling, score,
                                                        position - self.window)
        k = torch.where(written_valid[..., None], k, torch.zeros_like(k))
        return [k, v] + ([decay] if decay is not None else []) + gates

    def window_masses(self, cache: LinearLayerCache, x):
        """With the "attention" score (else None): the softmax mass received so far by the `window` tokens
        before x and by x's T tokens (zeros, to be added to), oldest first [B, window + T, Hkv] fp32."""
        if self.retain_score != "attention":
            return None
        B, T = x.shape[:2]
        held = cache.mass if cache.mass is not None else x.new_zeros(B, self.window, self.num_kv_heads,
                                                                      dtype=torch.float32)
        return torch.cat([held, held.new_zeros(B, T, held.shape[2])], dim=1)

    def window_and_linear_qkv(self, x, position_ids, cache: LinearLayerCache | None):
        """(the window softmax's q, k, v, then the linear part's before its feature map): the raw post-RoPE
        q, k, v for the window unless `conv_on_window`, the short conv's output (if any) for the linear part."""
        raw = self.qkv(x, position_ids)
        convolved = self.short_conv(*raw, cache)
        return (*(convolved if self.conv_on_window else raw), *convolved)

    def short_conv(self, q, k, v, cache: LinearLayerCache | None):
        """q, k, v after the short conv (if any), its inputs' history kept in `cache`."""
        if not self.conv:
            return q, k, v
        history = (cache.conv if cache is not None else None) or {}
        (q, hq), (k, hk), (v, hv) = (causal_conv(q, self.q_conv, history.get("q")),
                                     causal_conv(k, self.k_conv, history.get("k")),
                                     causal_conv(v, self.v_conv, history.get("v")))
        if cache is not None:
            cache.conv = {"q": hq, "k": hk, "v": hv}
        return q, k, v

    def output(self, lin, parts, dtype):
        """The mixer's output from the linear term and the softmax parts (numerator, row_max, row_sum) or None."""
        lin, normaliser = self.split_normaliser(lin)
        if self.output_gain is not None:  # linjax/mixers/linear.py `_apply_gain`
            lin = lin * self.output_gain[:, None]
            if normaliser is not None and self.window and self.combine == "sum":
                normaliser = normaliser * self.output_gain
        if parts is not None:
            y = self.combine_parts(lin, normaliser, parts[0], parts[2])
        elif normaliser is not None:
            y = lin / (normaliser[..., None] + 1e-10)
        else:
            y = lin
        return self.out(y.to(dtype))

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


# ----------------------------------------------------------------------------- the mechanisms


class GLA(LinearAttention):
    """S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ (paper, sec. 3.1.2), log α_t = LogSigmoid(h_t W1 W2 + b) per channel;
    with `linearize.gate` "liger_pooled_key", Liger's log α_t = LogSigmoid(k_proj(h_t)) / 16 per kv channel
    (linjax/mixers/gla.py: Liger's pool keeps k_proj's width, so it is the identity), no gate tensors; with
    `linearize.feature_map` "softmax", Liger's feature map."""

    mechanism = "gla"
    fla_kernel = "gla"

    def __init__(self, config):
        super().__init__(config)
        self.pooled_key_gate = config.linearize.get("gate", "low_rank") == "liger_pooled_key"
        self.feature_map = config.linearize.get("feature_map", "l2")
        if not self.pooled_key_gate:
            rank = int(config.linearize.get("gate_rank", 16))
            self.gate_down = nn.Linear(config.hidden_size, rank, bias=False)
            self.gate_up = nn.Linear(rank, self.num_heads * self.head_dim)

    def gates(self, h):
        b, t, _ = h.shape
        if self.pooled_key_gate:  # k_proj holds LoRA's update, merged by the export
            key = self.k_proj(h).float().view(b, t, self.num_kv_heads, self.head_dim)
            return [expand_kv(F.logsigmoid(key) / LIGER_GATE_NORMALIZER, self.num_heads)]
        return [F.logsigmoid(self.gate_up(self.gate_down(h.float()))).view(b, t, self.num_heads, self.head_dim)]

    def features(self, q, k, v):
        """`linearize.feature_map` "softmax": Liger's softmax over the head dimension, in fp32."""
        if self.feature_map == "softmax":
            return torch.softmax(q.float(), dim=-1).to(q.dtype), torch.softmax(k.float(), dim=-1).to(k.dtype), v
        return super().features(q, k, v)

    @staticmethod
    def decay_and_beta(k, gates):
        return gates[0], None


class GDN(GLA):
    """GLA's gate plus β_t = sigmoid(h_t W_β + b_β) per head, in the delta rule (Kimi's form, per-channel α):
    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ. FLA's KDA is this recurrence."""

    mechanism = "gdn"
    fla_kernel = "kda"

    def __init__(self, config):
        super().__init__(config)
        self.beta_proj = nn.Linear(config.hidden_size, self.num_heads)

    def gates(self, h):
        return super().gates(h) + [torch.sigmoid(self.beta_proj(h.float()))]

    @staticmethod
    def decay_and_beta(k, gates):
        return gates[0], gates[1]


class KGLA(GDN):
    """GDN's parameters; GLA's recurrence with the key-dependent decay α_t ⊙ max(1 − β_t k_t², 1e-6) (paper, sec. 3.3).
    FLA's GLA kernel runs it with the key gate folded into g."""

    mechanism = "kgla"
    fla_kernel = "gla"

    @staticmethod
    def decay_and_beta(k, gates):  # kernels/kgla.py key_log_gate
        erase = gates[1][..., None] * k * k
        return gates[0] + torch.log1p(-torch.clamp(erase, max=1.0 - KEY_GATE_FLOOR)), None


class GDNScalar(LinearAttention):
    """The original gated delta rule: GDN with one α_t = sigmoid(h_t W_α + b_α) per head (FLA's gated_delta_rule)."""

    mechanism = "gdn_scalar"
    fla_kernel = "gated_delta_rule"

    def __init__(self, config):
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size, self.num_heads)
        self.beta_proj = nn.Linear(config.hidden_size, self.num_heads)

    def gates(self, h):
        h = h.float()
        return [F.logsigmoid(self.gate_proj(h)), torch.sigmoid(self.beta_proj(h))]

    @staticmethod
    def decay_and_beta(k, gates):
        return gates[0][..., None].expand(k.shape), gates[1]

    @classmethod
    def fla_arguments(cls, k, gates):
        return {"g": gates[0], "beta": gates[1]}  # FLA takes the per-head gate as it is


class FeatureMap(nn.Module):
    """Hedgehog's φ(x) = softmax([2z, −2z]), z = xW + b, shared by the heads (FLA's HedgehogFeatureMap)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.proj = nn.Linear(head_dim, head_dim)

    def forward(self, x):
        z = 2 * self.proj(x.float())
        return torch.cat([z, -z], dim=-1).softmax(-1)


class Hedgehog(LinearAttention):
    """Normalised linear attention with learned feature maps (paper, sec. 3.1.1): S_t = Σ φ(k_i)[v_i, 1]ᵀ,
    y_t = φ(q_t)ᵀ S_t divided by its last column, φ(q_t)ᵀ z_t. No decay, no gates."""

    mechanism = "hedgehog"
    fla_kernel = "linear_attn"
    linear_scale = 1.0  # φ(q)ᵀφ(k) is already the kernel's similarity
    normalized = True

    def __init__(self, config):
        super().__init__(config)
        self.query_map, self.key_map = FeatureMap(self.head_dim), FeatureMap(self.head_dim)

    def gates(self, h):
        return []

    def features(self, q, k, v):
        ones = torch.ones_like(v[..., :1], dtype=torch.float32)
        return self.query_map(q), self.key_map(k), torch.cat([v.float(), ones], dim=-1)  # v → [v, 1]

    def split_normaliser(self, o):
        return o[..., :-1], o[..., -1]

    @staticmethod
    def decay_and_beta(k, gates):
        return torch.zeros_like(k), None

    @classmethod
    def fla_arguments(cls, k, gates):
        return {"normalize": False}  # the normaliser is v's last column


# ----------------------------------------------------------------------------- by mechanism name


def run_linear(form: str, kind: str, q, k, v, gates, scale: float, initial_state=None):
    """Mechanism `kind`'s recurrence in `form` (see `LinearAttention.linear_kernel`)."""
    return MIXERS[kind].linear_kernel(form, q, k, v, gates, scale, initial_state)


def linear_recurrence(kind: str, q, k, v, gates, scale: float, initial_state=None):
    """(o [B,T,H,Dv], final state [B,H,Dk,Dv]) of mechanism `kind`, token by token (fp32): the reference."""
    return run_linear("recurrent", kind, q, k, v, gates, scale, initial_state)


def chunked_linear(kind: str, q, k, v, gates, scale: float, initial_state=None):
    """`linear_recurrence`'s (o, final state) computed 16 tokens at a time."""
    return run_linear("chunked", kind, q, k, v, gates, scale, initial_state)


def fla_linear(kind: str, q, k, v, gates, scale: float, initial_state=None, kernels=None):
    """`chunked_linear` on flash-linear-attention's chunk kernels: same arguments, same (o, final state).
    `kernels`: {"gla", "kda", "gated_delta_rule", "linear_attn"} → function (default `fla_kernels()`;
    the tests pass FLA's naive references, which take the same keyword arguments)."""
    return MIXERS[kind].linear_kernel("fla", q, k, v, gates, scale, initial_state, kernels=kernels)

