"""K3 of the chunked Pallas kernels (chunk_pallas.py): every chunk's outputs from the state entering it,

    o_n = q̃_n S_n + A^{qk}_n U_n        (q̃ = scale · Q ⊙ Γ and A^{qk} carry the scale: chunk_intra_pallas.py)

one program per (chunk, batch × head, block of value columns), all independent. Two dots with operands
in the model's dtype and fp32 accumulation; o is written in `out_dtype`.

    chunk_outputs(q_gated, a_qk, states, new_values, *, chunk, dtype, out_dtype, interpret) -> o [B,T,H,Dv]
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import MAX_BLOCK_V, Layout, dot, operand_type, triton_params


def _kernel(qg_ref, a_ref, s_ref, u_ref, o_ref, *, dtype):
    o_ref[...] = (dot(qg_ref[...], s_ref[...], dtype) + dot(a_ref[...], u_ref[...], dtype)).astype(o_ref.dtype)


def chunk_outputs(q_gated, a_qk, states, new_values, *, chunk: int, dtype, out_dtype, interpret: bool):
    """q_gated [B,T,H,Dk], a_qk [B,T,H,C], states [B,N,H,Dk,Dv], new_values [B,T,H or Hkv,Dv]."""
    B, T, H, Dk = q_gated.shape
    Dv = new_values.shape[-1]
    BV = min(Dv, MAX_BLOCK_V)
    layout = Layout(H, new_values.shape[2], chunk)
    on = functools.partial(layout.tokens, axes="nbj")
    return pl.pallas_call(
        functools.partial(_kernel, dtype=operand_type(dtype, interpret)),
        out_shape=jax.ShapeDtypeStruct((B, T, H, Dv), out_dtype), grid=(T // chunk, B * H, Dv // BV),
        in_specs=[on(Dk), on(chunk), layout.per_chunk(Dk, Dv, axes="nbj", col_block=BV),
                  on(Dv, kv=new_values.shape[2] != H, col_block=BV)],
        out_specs=on(Dv, col_block=BV), compiler_params=triton_params(), interpret=interpret,
        name="linjax_chunk_output_fwd",
    )(q_gated, a_qk, states, new_values)
