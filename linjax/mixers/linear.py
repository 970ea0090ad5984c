"""What every linear mixer shares: the frozen projections, adapters, sinks + window, and decode states.

A linear mixer computes (paper, sec. 4)

    y_t = q_t S_{s:t-w} + softmax-attention(q_t; positions in I_t)

with I_t the s sink tokens and the w most recent ones, so every past token
reaches y_t exactly once. With w = s = 0 it is pure linear attention, the
paper's strict setting. The softmax part uses the pretrained queries and keys
as they are (post-RoPE), so inside the window the mixer is the original
attention; the linear part uses them after the short convolution (if any)
and the mechanism's feature transform (L2 normalisation, or Hedgehog's maps).
`SinksWindow` (sinks_window.py) owns the softmax part, the shift of the linear
inputs and their decode cache; one call is the pipeline

    projections → short conv → features, gates → SinksWindow → linear kernel → gain → combine → out

The linear term is scaled by `scale` (LinearizeConfig: 1 by default, the
paper's y = qᵀS; None: the mechanism's own, Dk^-1/2 as in FLA's kernels, 1 for
Hedgehog) and, with `output_gain`, by a learned per-head gain g_h (initialised
to 1). With L2-normalised q and k the delta rule's output is bounded by about
scale · ‖v‖, so both decide whether the linear part can reach the output size
of the softmax attention it replaces (at Dk^-1/2 pure GDN does not: results/README.md).

A subclass (one file per mechanism) names its mechanism (`mechanism`, the name
LinearizeConfig, the export and every test grid use), its kernel module in `linjax.kernels`
(`kernel_module`) and FLA's op for the same recurrence (`fla_kernel`), provides the new
parameters, `gates(h, k)` and `features(q, k)`, says how the PyTorch mirror names its
parameters (`mechanism_tensors`), and makes example gates for tests and benchmarks
(`example_gates`; `example_inputs` adds q, k, v). `linjax.linearize.MIXERS` is the registry:
tests and benchmarks read these attributes from it instead of listing mechanisms by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax.adapters import LoRA, ShortConv
from linjax.kernels import scaling
from linjax.kernels.swa import SoftmaxParts
from linjax.layers import AttentionProjections, Trainable, apply_rope, float32_array, rope_inverse_frequencies
from linjax.mixers import linear_retained
from linjax.mixers.sinks_window import SinksWindow
from linjax.mixers.states import LinearState


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / ‖x‖ over the last axis, in fp32 (as FLA's l2norm). The sum and the scaling are
    matrix-vector products in the backward (kernels/scaling.py)."""
    x32 = x.astype(jnp.float32)
    return scaling.scale_rows(jax.lax.rsqrt(scaling.row_sums(x32 * x32) + eps), x32).astype(x.dtype)


class LinearMixer(nnx.Module):
    """Base class: subclasses set `mechanism` and `kernel` and implement `gates` and `mechanism_tensors`
    (and `features` if not L2)."""

    mechanism = None  # the mechanism's name (LinearizeConfig.mechanism); None: not a mechanism
    kernel_module = None  # a module of linjax.kernels with reference/chunked/step/pallas
    # flash-linear-attention's op with the same recurrence (`fla.ops.<name>`): what the PyTorch export
    # runs on CUDA, and the kernel benchmarks' comparison. None: FLA has none.
    fla_kernel = None
    normalized = False  # True for normalised linear attention (Hedgehog): shares the softmax normaliser
    linear_scale = None  # the mechanism's default scale (None: the kernel's Dk^-1/2)
    # Linear inputs (k', v', *gates) that belong to a step rather than to a token: the decay, the first
    # gate of every gated mechanism. With retained tokens the state decays by the leaving token's gate at
    # each step, whichever token it stores (SinksWindow.retaining_step).
    decay_inputs = (2,)

    def __init__(self, proj: AttentionProjections, settings, *, rngs: nnx.Rngs):
        """`proj`: the pretrained projections (shared, not copied); `settings`: a LinearizeConfig."""
        self.proj = proj
        self.sinks_window = SinksWindow.from_settings(settings)
        self.combine = settings.combine
        self.chunk = settings.chunk
        self.scale = self.linear_scale if settings.scale is None else settings.scale
        self.use_pallas = settings.uses_pallas()
        heads, kv_heads, head_dim = proj.num_heads, proj.num_kv_heads, proj.head_dim
        self.lora = (LoRA(proj, rank=settings.lora_rank, alpha=settings.lora_alpha, targets=settings.lora_targets,
                          rngs=rngs) if settings.uses_lora else None)
        self.linear_rope = settings.linear_rope
        self.state_covers_window = settings.state_covers_window
        self.conv = (ShortConv(heads * head_dim, kv_heads * head_dim, kernel_size=settings.conv_kernel,
                               init=settings.conv_init, rngs=rngs)
                     if settings.uses_shortconv else None)
        self.conv_on_window = settings.conv_on_window
        # A learned gain per head on the linear term; 1 at init (by default), so the untrained model is unchanged.
        self.output_gain = (Trainable(jnp.full((heads,), settings.output_gain_init, jnp.float32))
                            if settings.output_gain else None)

    # ---------------------------------------------------------------- per mechanism

    def features(self, q, k):
        """q, k after RoPE (and short conv) → the kernel's q, k. Default: L2 normalisation."""
        return l2_normalize(q), l2_normalize(k)

    def gates(self, h, k):
        """Gate arrays for the kernel, computed from the block input h [B,T,d] (k: the kernel's keys)."""
        raise NotImplementedError

    def feature_dim(self) -> int:
        return self.proj.head_dim

    def mechanism_tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The mechanism's new parameters under `prefix` as the PyTorch mirror's class for it names them
        (convert/modeling_linjax_linear.py), in torch's layout, float32."""
        raise NotImplementedError

    # ---------------------------------------------------------------- for tests and benchmarks

    @classmethod
    def example_gates(cls, key: jax.Array, batch: int, time: int, heads: int, key_dim: int) -> tuple:
        """Random gates as `gates(h, k)` returns them and `kernel_module` takes them (fp32, [B,T,H,...]),
        in the range a trained mixer gives: decays in log space near α ≈ 0.9, β in (0, 1)."""
        raise NotImplementedError

    @classmethod
    def example_features(cls, q: jax.Array, k: jax.Array):
        """Random q, k turned into what the kernel reads, as `features` does at initialisation: L2-normalised."""
        return l2_normalize(q), l2_normalize(k)

    @classmethod
    def example_inputs(cls, key: jax.Array, batch: int = 2, time: int = 37, heads: int = 4, kv_heads: int = 2,
                       head_dim: int = 16, dtype=jnp.float32) -> tuple:
        """Random (q, k, v, *gates) for `kernel_module`'s four forms: q [B,T,H,Dk], k [B,T,Hkv,Dk] after
        the mechanism's features (Dk = `feature_dim` of head_dim), v [B,T,Hkv,head_dim] in `dtype`,
        the gates in fp32."""
        q_key, k_key, v_key, gate_key = jax.random.split(key, 4)
        q = jax.random.normal(q_key, (batch, time, heads, head_dim), jnp.float32)
        k = jax.random.normal(k_key, (batch, time, kv_heads, head_dim), jnp.float32)
        v = jax.random.normal(v_key, (batch, time, kv_heads, head_dim), jnp.float32)
        q, k = cls.example_features(q, k)
        gates = cls.example_gates(gate_key, batch, time, heads, q.shape[-1])
        return (q.astype(dtype), k.astype(dtype), v.astype(dtype), *gates)

    # ---------------------------------------------------------------- export

    def torch_tensors(self, prefix: str, pretrained: dict) -> dict[str, np.ndarray]:
        """What the PyTorch export writes for this layer under `prefix` (model.layers.i.self_attn) beyond
        `pretrained` (the base tensors by HF name): q/k/v/o_proj with LoRA merged in, the mechanism's
        parameters, the short conv and the output gain."""
        out = {} if self.lora is None else self.lora.merged_weights(prefix, pretrained)
        out.update(self.mechanism_tensors(prefix))
        if self.conv is not None:
            out.update(self.conv.torch_tensors(prefix))
        if self.output_gain is not None:
            out[f"{prefix}.output_gain"] = float32_array(self.output_gain)
        return out

    # ---------------------------------------------------------------- shared machinery

    def _run_kernel(self, q, k, v, gates, state: LinearState | None):
        """(output or numerator, new state, normaliser or None) from the mechanism's kernel."""
        decode = state is not None and q.shape[1] == 1
        state = None if state is None else state.linear
        extra = {"normalize": False} if self.normalized else {}
        if self.chunk is not None and not decode:
            extra["chunk"] = self.chunk
        if self.scale is not None:
            extra["scale"] = self.scale
        if decode:
            out, state = self.kernel_module.step(q[:, 0], k[:, 0], v[:, 0], *(g[:, 0] for g in gates),
                                                 state=state, **extra)
            out = jax.tree.map(lambda x: x[:, None], out)  # back to one time step
        else:
            run = self.kernel_module.pallas if self.use_pallas else self.kernel_module.chunked
            out, state = run(q, k, v, *gates, initial_state=state, **extra)
        if self.normalized:  # linear_attn.NormalizedOutput
            return out.o, state, out.normaliser
        return out, state, None

    def init_state(self, batch: int, max_length: int, dtype=jnp.float32) -> LinearState:
        del max_length  # a linear layer's state does not grow with the context
        proj = self.proj
        heads, kv_heads, head_dim = proj.num_heads, proj.num_kv_heads, proj.head_dim
        value_dim = head_dim + (1 if self.normalized else 0)
        linear = jnp.zeros((batch, heads, self.feature_dim(), value_dim), jnp.float32)
        conv = None if self.conv is None else self.conv.empty_caches(
            batch, heads * head_dim, kv_heads * head_dim, dtype)
        # One ring per linear input, shaped like a single time step of it (traced only with a window).
        window = None
        if self.sinks_window.window:
            shapes = self._linear_input_shapes(batch, dtype)
            window = self.sinks_window.empty_cache(batch, kv_heads, head_dim, dtype, linear_inputs=shapes,
                                                   stays=self._stays(shapes))
        return LinearState(linear, jnp.zeros((), jnp.int32), conv, window)

    def _stays(self, linear_inputs) -> tuple:
        return tuple(i for i in self.decay_inputs if i < len(linear_inputs))

    def _linear_input_shapes(self, batch, dtype):
        """Shapes of (k', v', *gates) for one token, found by tracing the mixer's own transforms."""
        d = self.proj.q_proj.kernel.shape[0]

        def one_token(h):
            positions = jnp.zeros((batch, 1), jnp.int32)
            q, k, v = self.proj.qkv(h, positions, self.lora)
            q, k = self.features(q, k)
            return (k, v) + tuple(self.gates(h, k))

        return jax.eval_shape(one_token, jax.ShapeDtypeStruct((batch, 1, d), dtype))

    def __call__(self, x: jax.Array, positions: jax.Array, state: LinearState | None = None):
        if self.sinks_window.retain_block > 1:
            return linear_retained.by_blocks(self, x, positions, state)
        if self.sinks_window.retain:
            return linear_retained.by_tokens(self, x, positions, state)
        q, k, v = self.proj.qkv(x, positions, self.lora)
        softmax_qkv, (q, k, v), conv_state = self._window_and_linear_qkv(q, k, v, state)
        q, k = self.features(*self._linear_rope(q, k, positions))
        gates = tuple(self.gates(x, k))
        parts, (lin_k, lin_v, *lin_gates), window_state = self.sinks_window(
            *softmax_qkv, linear_inputs=(k, v) + gates, cache=None if state is None else state.window)
        if self.state_covers_window:  # Liger: every token enters the state at once, the window's too
            lin_k, lin_v, lin_gates = k, v, gates
        lin_out, linear_state, normaliser = self._run_kernel(q, lin_k, lin_v, lin_gates, state)
        y = self._combine(*self._apply_gain(lin_out, normaliser), parts)
        out = self.proj.out(y.astype(x.dtype), self.lora)
        if state is None:
            return out
        return out, LinearState(linear_state, state.length + x.shape[1], conv_state, window_state)

    def _linear_rope(self, q, k, positions):
        """The linear part's q and k: as they are (with RoPE), or with `linear_rope` off, rotated back by their
        positions to what the projections gave (Liger-GLA's feature maps read q and k before RoPE)."""
        if self.linear_rope:
            return q, k
        inverse = -rope_inverse_frequencies(self.proj.config)  # the opposite rotation undoes RoPE
        return apply_rope(q, positions, inverse), apply_rope(k, positions, inverse)

    def _window_and_linear_qkv(self, q, k, v, state):
        """(the window softmax's q, k, v; the linear part's, before its feature map; the conv's caches).
        The window attends with the pretrained queries and keys as they are, unless `conv_on_window`."""
        convolved, conv_state = self._short_conv(q, k, v, state)
        return (convolved if self.conv_on_window else (q, k, v)), convolved, conv_state

    def _short_conv(self, q, k, v, state):
        """q, k, v after the short convolution (if any), and its caches after them."""
        if self.conv is None:
            return (q, k, v), None
        return self.conv(q, k, v, None if state is None else state.conv)

    def _apply_gain(self, lin_out, normaliser):
        """The linear term [B,T,H,Dv] (and Hedgehog's normaliser [B,T,H]) times the per-head gain.

        Scaling the numerator scales the linear output itself: after Hedgehog's own
        normalisation when it has no window or combine="mixed". With combine="sum" and a
        window, Hedgehog divides numerator + window numerator by one shared normaliser
        (LoLCATs); there the gain multiplies the linear normaliser too, so the output stays
        a convex combination of values, as the softmax it imitates, and g_h weighs the
        linear part's attention mass against the window's (as a scale does in that form).
        Scaling only the numerator would break that and leave the rows' weights summing to ≠ 1.
        This form needs g_h > 0 (it starts at 1); the others take any sign.
        """
        if self.output_gain is None:
            return lin_out, normaliser
        gain = self.output_gain[...]
        lin_out = lin_out.astype(jnp.float32) * gain[:, None]
        if self.normalized and self.sinks_window.window and self.combine == "sum":
            normaliser = normaliser * gain
        return lin_out, normaliser

    def _combine(self, lin_out, normaliser, parts: SoftmaxParts | None):
        """y from the linear term and the window's softmax parts (None: no window)."""
        if parts is None:
            return lin_out / (normaliser[..., None] + 1e-10) if self.normalized else lin_out
        lin_out = lin_out.astype(jnp.float32)
        if self.normalized and self.combine == "sum":
            # One shared normaliser over both parts (LoLCATs).
            return (parts.numerator + lin_out) / (parts.row_sum + normaliser)[..., None]
        if self.normalized:
            lin_out = lin_out / (normaliser[..., None] + 1e-10)
        if self.combine == "mixed":  # Liger: 0.5 · linear + 0.5 · window
            return 0.5 * lin_out + 0.5 * parts.normalized()
        return lin_out + parts.normalized()
