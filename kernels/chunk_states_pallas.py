"""The chunk-state pass of chunk_states.py as a Pallas (Triton) kernel, with its reverse for the
backward behind a `jax.custom_vjp`.

Forward, per chunk n (chunk_states.py has the equations):

    states[n] = S;   U = values[n] − W[n] S  (the delta rule; GLA: U = values[n]);
    S ← Diag(decay[n]) S + k_out[n]ᵀ U

Backward, with dS = ∂L/∂S_{n+1} carried from the last chunk to the first:

    dU = ∂L/∂U_n + k_out[n] dS            → ∂L/∂values[n] (GLA: dU = k_out[n] dS)
    ∂L/∂k_out[n] = U dSᵀ,  ∂L/∂decay[n] = Σ_v S ⊙ dS,  ∂L/∂W[n] = −dU Sᵀ
    dS ← Diag(decay[n]) dS − W[n]ᵀ dU + ∂L/∂states[n]

Layout as FLA's `chunk_delta_h`: one program per (block of BV value columns, batch × head), the
fp32 state [Dk, BV] carried in registers through a `fori_loop` over the chunks (a loop, not
unrolled: the kernel's size does not grow with T), two dots a chunk forward, four backward. Dot
operands are in the model's dtype (bf16 on tensor cores; fp32 at full precision, not TF32) with fp32
accumulation; the states entering each chunk and the new values U are stored in that dtype. Value
columns are independent, so the key-side gradients (k_out, W, decay) come out per value block and
are summed outside.

    state_pass(k_out, values, w, decay, state, *, dtype, interpret) -> (states, new_values, final)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import MAX_BLOCK_V, pad_axis, tile_size, triton_params

_F32 = jnp.float32


def _exact_if_fp32(a):
    """fp32 operands at full precision: Triton would run them as TF32 (10-bit mantissas) otherwise,
    and an fp32 model means fp32 states. bf16 operands take the tensor cores' native dot."""
    return lax.Precision.HIGHEST if a.dtype == _F32 else None


def _dot(a, b):
    """a @ b in the operands' dtype, accumulated in fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_exact_if_fp32(a), preferred_element_type=_F32)


def _dot_t(a, b):
    """a @ bᵀ."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_exact_if_fp32(a), preferred_element_type=_F32)


def _t_dot(a, b):
    """aᵀ @ b."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_exact_if_fp32(a), preferred_element_type=_F32)


def _forward_kernel(*refs, delta: bool, n_chunks: int):
    if delta:
        k_ref, values_ref, w_ref, decay_ref, state_ref, states_ref, new_values_ref, final_ref = refs
    else:
        k_ref, values_ref, decay_ref, state_ref, states_ref, final_ref = refs
    dtype = k_ref.dtype

    def one_chunk(n, S):                                      # S [Dk, BV] fp32, entering chunk n
        states_ref[n] = S.astype(states_ref.dtype)
        u = values_ref[n].astype(_F32)
        if delta:
            u = u - _dot(w_ref[n], S.astype(dtype))
            new_values_ref[n] = u.astype(new_values_ref.dtype)
        return decay_ref[n][:, None] * S + _t_dot(k_ref[n], u.astype(dtype))

    final_ref[...] = lax.fori_loop(0, n_chunks, one_chunk, state_ref[...])


def _backward_kernel(*refs, delta: bool, n_chunks: int):
    if delta:
        (k_ref, w_ref, decay_ref, states_ref, u_ref, d_states_ref, d_u_ref, d_final_ref,
         d_values_ref, d_k_ref, d_w_ref, d_decay_ref, d_state_ref) = refs
    else:
        (k_ref, u_ref, decay_ref, states_ref, d_states_ref, d_final_ref,
         d_values_ref, d_k_ref, d_decay_ref, d_state_ref) = refs
    dtype = k_ref.dtype

    def one_chunk(i, dS):                                     # dS = ∂L/∂S_{n+1}, [Dk, BV] fp32
        n = n_chunks - 1 - i
        S = states_ref[n].astype(_F32)
        dS_low = dS.astype(dtype)
        du = _dot(k_ref[n], dS_low)
        if delta:
            du = du + d_u_ref[n].astype(_F32)
        d_values_ref[n] = du
        d_k_ref[n] = _dot_t(u_ref[n], dS_low)
        d_decay_ref[n] = jnp.sum(S * dS, axis=1)
        dS_prev = decay_ref[n][:, None] * dS + d_states_ref[n].astype(_F32)
        if delta:
            du_low = du.astype(dtype)
            d_w_ref[n] = -_dot_t(du_low, S.astype(dtype))
            dS_prev = dS_prev - _t_dot(w_ref[n], du_low)
        return dS_prev

    d_state_ref[...] = lax.fori_loop(0, n_chunks, one_chunk, d_final_ref[...].astype(_F32))


def _specs(N, C, Dk, BV):
    """BlockSpecs on grid (value block j, batch × head bh) for [N, BH, ...] arrays, and the
    per-value-block partials [n_v, N, BH, ...]."""
    sq = pl.squeezed
    return dict(
        keys=pl.BlockSpec((N, sq, C, Dk), lambda j, bh: (0, bh, 0, 0)),
        values=pl.BlockSpec((N, sq, C, BV), lambda j, bh: (0, bh, 0, j)),
        decay=pl.BlockSpec((N, sq, Dk), lambda j, bh: (0, bh, 0)),
        state=pl.BlockSpec((sq, Dk, BV), lambda j, bh: (bh, 0, j)),
        states=pl.BlockSpec((N, sq, Dk, BV), lambda j, bh: (0, bh, 0, j)),
        key_partial=pl.BlockSpec((sq, N, sq, C, Dk), lambda j, bh: (j, 0, bh, 0, 0)),
        decay_partial=pl.BlockSpec((sq, N, sq, Dk), lambda j, bh: (j, 0, bh, 0)),
    )


def _grid(k_out, values):
    N, BH, C, Dk = k_out.shape
    Dv = values.shape[-1]
    BV = min(Dv, MAX_BLOCK_V)
    return (Dv // BV, BH), _specs(N, C, Dk, BV)


def _forward(k_out, values, w, decay, state, interpret):
    delta = w is not None
    N, BH, C, Dk = k_out.shape
    Dv = values.shape[-1]
    grid, specs = _grid(k_out, values)
    out_shape = [jax.ShapeDtypeStruct((N, BH, Dk, Dv), k_out.dtype)]
    out_specs = [specs["states"]]
    if delta:
        out_shape.append(jax.ShapeDtypeStruct((N, BH, C, Dv), k_out.dtype))
        out_specs.append(specs["values"])
    out_shape.append(jax.ShapeDtypeStruct((BH, Dk, Dv), _F32))
    out_specs.append(specs["state"])
    inputs = [k_out, values] + ([w] if delta else []) + [decay, state]
    in_specs = [specs["keys"], specs["values"]] + ([specs["keys"]] if delta else []) + [specs["decay"],
                                                                                        specs["state"]]
    out = pl.pallas_call(
        functools.partial(_forward_kernel, delta=delta, n_chunks=N),
        out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=triton_params(), interpret=interpret, name="linjax_chunk_states_fwd",
    )(*inputs)
    states, final = out[0], out[-1]
    return states, (out[1] if delta else values), final


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _state_pass(k_out, values, w, decay, state, interpret):
    return _forward(k_out, values, w, decay, state, interpret)


def _state_pass_forward(k_out, values, w, decay, state, interpret):
    states, new_values, final = _forward(k_out, values, w, decay, state, interpret)
    return (states, new_values, final), (k_out, w, decay, states, new_values)


def _state_pass_backward(interpret, saved, cotangents):
    k_out, w, decay, states, new_values = saved
    d_states, d_new_values, d_final = cotangents
    delta = w is not None
    N, BH, C, Dk = k_out.shape
    Dv = new_values.shape[-1]
    grid, specs = _grid(k_out, new_values)
    n_v = grid[0]
    out_shape = [jax.ShapeDtypeStruct((N, BH, C, Dv), _F32), jax.ShapeDtypeStruct((n_v, N, BH, C, Dk), _F32)]
    out_specs = [specs["values"], specs["key_partial"]]
    if delta:
        out_shape.append(jax.ShapeDtypeStruct((n_v, N, BH, C, Dk), _F32))
        out_specs.append(specs["key_partial"])
    out_shape += [jax.ShapeDtypeStruct((n_v, N, BH, Dk), _F32), jax.ShapeDtypeStruct((BH, Dk, Dv), _F32)]
    out_specs += [specs["decay_partial"], specs["state"]]
    if delta:
        inputs = [k_out, w, decay, states, new_values, d_states, d_new_values, d_final]
        in_specs = [specs["keys"], specs["keys"], specs["decay"], specs["states"], specs["values"],
                    specs["states"], specs["values"], specs["state"]]
    else:
        inputs = [k_out, new_values, decay, states, d_states, d_final]
        in_specs = [specs["keys"], specs["values"], specs["decay"], specs["states"], specs["states"],
                    specs["state"]]
    out = pl.pallas_call(
        functools.partial(_backward_kernel, delta=delta, n_chunks=N),
        out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=triton_params(), interpret=interpret, name="linjax_chunk_states_bwd",
    )(*inputs)
    if delta:
        d_values, d_k, d_w, d_decay, d_state = out
        d_w = d_w.sum(0).astype(w.dtype)
    else:  # the new values are the values themselves: their cotangent passes straight through
        (d_values, d_k, d_decay, d_state), d_w = out, None
        d_values = d_values + d_new_values.astype(_F32)
    return (d_k.sum(0).astype(k_out.dtype), d_values.astype(new_values.dtype), d_w, d_decay.sum(0),
            d_state)


_state_pass.defvjp(_state_pass_forward, _state_pass_backward)


def state_pass(k_out, values, w, decay, state, *, dtype, interpret):
    """chunk_states.scan's arguments and results ([N, B, H, ...] fp32 in; `decay` None means none),
    run by the Pallas kernels with dot operands in `dtype`. Dk and Dv are padded to Triton tiles;
    C must be a power of two ≥ 16. The states and new values come back in `dtype`."""
    N, B, H, C, Dk = k_out.shape
    Dv = values.shape[-1]
    Dkp, Dvp = tile_size(Dk), tile_size(Dv)
    decay = jnp.ones((N, B, H, Dk), _F32) if decay is None else jnp.broadcast_to(decay, (N, B, H, Dk))

    def flat(x, width, cast=True):                           # [N, B, H, ..., D] -> [N, B·H, ..., Dp]
        x = pad_axis(x, x.ndim - 1, width).reshape(N, B * H, *x.shape[3:-1], width)
        return x.astype(dtype) if cast else x

    state = pad_axis(pad_axis(state, 2, Dkp), 3, Dvp).reshape(B * H, Dkp, Dvp)
    states, new_values, final = _state_pass(
        flat(k_out, Dkp), flat(values, Dvp), None if w is None else flat(w, Dkp), flat(decay, Dkp, cast=False),
        state, interpret)
    states = states.reshape(N, B, H, Dkp, Dvp)[..., :Dk, :Dv]
    new_values = new_values.reshape(N, B, H, C, Dvp)[..., :Dv]
    return states, new_values, final.reshape(B, H, Dkp, Dvp)[..., :Dk, :Dv]
