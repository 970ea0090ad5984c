"""What the Pallas (Triton backend) kernels here share: tile sizes and padding, block specs for the
[batch, time, heads, dim] layout, dots with fp32 accumulation, launch settings, and the choice between
the compiled kernel and the interpreter by the platform a program is lowered for."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
SUB = 16  # rows of a sub-chunk: Triton's smallest dot side
PALLAS_MIN_CHUNK = 16
MAX_BLOCK_V = 64  # value columns per program of the state passes, at most


# ---------------------------------------------------------------- wrapper side


def check_pallas_chunk(chunk: int):
    """The chunk of the chunked Pallas kernels: a power of two ≥ 16 (whole sub-chunks of 16 rows)."""
    if chunk < PALLAS_MIN_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two ≥ {PALLAS_MIN_CHUNK}; got {chunk}")


def tile_size(n: int) -> int:
    """Smallest power of two ≥ max(n, 16): Triton tiles are powers of two and its dots need sides ≥ 16."""
    return max(16, pl.next_power_of_2(n))


def pad_axis(x, axis: int, size: int, value=0.0):
    """Pad `x` with `value` at the end of `axis` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def triton_params(num_warps: int = 4):
    """Triton launch settings (selecting them is what picks the Triton backend over Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def value_block(value_dim: int, programs_per_block: int, dtype, target_programs: int = 128) -> int:
    """Value columns per program of a pass whose grid is (value blocks, `programs_per_block`): the widest
    of 64, 32, 16 that still gives `target_programs` programs (an H100 has 132 SMs), else 16; 16 for fp32
    operands (TF32×3 dots hold each operand twice: wider blocks spill registers)."""
    widest = 16 if jnp.dtype(dtype) == F32 else MAX_BLOCK_V
    for width in (w for w in (MAX_BLOCK_V, 32, 16) if w <= widest):
        if width <= value_dim and (value_dim // width) * programs_per_block >= target_programs:
            return width
    return min(16, value_dim)


def by_platform(run, *arrays, interpret=None):
    """run(*arrays, interpret=...) with the Pallas kernels interpreted where the program is lowered for a
    CPU and compiled by Triton elsewhere (`lax.platform_dependent`: a CUDA lowering made on a CPU machine
    holds the Triton kernels). `interpret` True or False forces one."""
    if interpret is not None:
        return run(*arrays, interpret=bool(interpret))
    return lax.platform_dependent(*arrays, cpu=functools.partial(run, interpret=True),
                                  default=functools.partial(run, interpret=False))


class Layout:
    """Block specs for [B, T, heads, ...] arrays on a grid whose axes include the chunk n and the
    flattened (batch, query head) index bh: a program reads its chunk of one head in place, with no
    transposes. Key and value arrays with fewer heads (GQA) are read through the query head's kv head."""

    def __init__(self, heads: int, kv_heads: int, chunk: int):
        self.heads, self.group, self.chunk = heads, heads // kv_heads, chunk

    def _b_h(self, bh, kv):
        return bh // self.heads, (bh % self.heads) // (self.group if kv else 1)

    def tokens(self, width: int, axes: str, kv: bool = False, col_block: int | None = None):
        """[B, T, H, width] read as [chunk, width] (or [chunk, col_block] at block j) on a grid named by
        `axes`, a string of "n" (chunk), "b" (bh) and "j" (column block), e.g. "nb" or "nbj"."""
        def index(*ids):
            ids = dict(zip(axes, ids))
            b, h = self._b_h(ids["b"], kv)
            return b, ids["n"], h, ids.get("j", 0) if col_block else 0
        return pl.BlockSpec((None, self.chunk, None, col_block or width), index)

    def sub_chunk(self, width: int, axes: str, kv: bool = False):
        """[B, T, H, width] read as the 16 rows [16, width] of sub-chunk s of chunk n (grid axes "nbs")."""
        per_chunk = self.chunk // SUB

        def index(*ids):
            ids = dict(zip(axes, ids))
            b, h = self._b_h(ids["b"], kv)
            return b, ids["n"] * per_chunk + ids["s"], h, 0
        return pl.BlockSpec((None, SUB, None, width), index)

    def whole_sequence(self, length: int, width: int, axes: str, kv: bool = False, col_block: int | None = None):
        """[B, T, H, width] read as the whole sequence [T, width] (or [T, col_block]) of one head."""
        def index(*ids):
            ids = dict(zip(axes, ids))
            b, h = self._b_h(ids["b"], kv)
            return b, 0, h, ids.get("j", 0) if col_block else 0
        return pl.BlockSpec((None, length, None, col_block or width), index)

    def per_head(self, *tail, axes: str, col_block: int | None = None):
        """[B, H, *tail] (a state) read as [*tail] of one head (its last axis in blocks at j)."""
        def index(*ids):
            ids = dict(zip(axes, ids))
            b, h = self._b_h(ids["b"], False)
            return (b, h) + (0,) * (len(tail) - 1) + (ids.get("j", 0) if col_block else 0,)
        return pl.BlockSpec((None, None, *tail[:-1], col_block or tail[-1]), index)

    def per_chunk(self, *tail, axes: str, all_chunks: bool = False, col_block: int | None = None,
                  n_chunks: int | None = None):
        """[B, N, H, *tail] (one entry per chunk) read as [*tail] of chunk n, or [N, *tail] of all."""
        def index(*ids):
            ids = dict(zip(axes, ids))
            b, h = self._b_h(ids["b"], False)
            last = ids.get("j", 0) if col_block else 0
            return (b, 0 if all_chunks else ids["n"], h) + (0,) * (len(tail) - 1) + (last,)
        block = (None, n_chunks if all_chunks else None, None, *tail[:-1], col_block or tail[-1])
        return pl.BlockSpec(block, index)


# ------------------------------------------------------------ in-kernel pieces


TF32X3 = "tf32x3"  # dot operands: fp32 values as three TF32 products on the tensor cores (compiled kernels)


def operand_type(dtype, interpret: bool):
    """What the dots of a kernel for `dtype` take: bf16 / fp16 operands as they are (the tensor cores'
    native dot); fp32 operands at about fp32's accuracy, as IEEE fp32 in the interpreter and as TF32×3
    when compiled. (Triton's default for fp32 is one TF32 pass, a 10-bit mantissa; its IEEE fp32 dot
    runs on the CUDA cores and needs so many registers that the state passes spill tens of KB.)"""
    dtype = jnp.dtype(dtype)
    return TF32X3 if dtype == F32 and not interpret else dtype


def _operands(dtype):
    """(the type operands are cast to, the dot's precision) for an operand_type."""
    if isinstance(dtype, str) and dtype == TF32X3:
        return F32, lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    dtype = jnp.dtype(dtype)
    return dtype, (lax.Precision.HIGHEST if dtype == F32 else None)


def _dot_general(a, b, dims, dtype):
    cast, precision = _operands(dtype)
    return lax.dot_general(a.astype(cast), b.astype(cast), (dims, ((), ())), precision=precision,
                           preferred_element_type=F32)


def dot(a, b, dtype):
    """a @ b with operands of `dtype` (an operand_type), accumulated in fp32."""
    return _dot_general(a, b, ((1,), (0,)), dtype)


def dot_t(a, b, dtype):
    """a @ bᵀ, operands of `dtype`, fp32 accumulation."""
    return _dot_general(a, b, ((1,), (1,)), dtype)


def t_dot(a, b, dtype):
    """aᵀ @ b, operands of `dtype`, fp32 accumulation."""
    return _dot_general(a, b, ((0,), (0,)), dtype)


def column_loop(width: int, body, init, dtype):
    """lax.fori_loop over blocks of `width` columns: body(pl.ds of the block's columns, carry) -> carry.
    Blocks of 64 columns, 32 for fp32 operands (`dtype` an operand_type), so a kernel holds few large
    tiles at once."""
    block = min(width, 64 if _operands(dtype)[0] != F32 else 32)
    return lax.fori_loop(0, width // block, lambda j, carry: body(pl.ds(j * block, block), carry), init)


def rows(n: int, m: int = 1):
    return lax.broadcasted_iota(jnp.int32, (n, m), 0)


def cols(n: int, m: int = 1):
    return lax.broadcasted_iota(jnp.int32, (m, n), 1)


def identity(n: int):
    return jnp.where(rows(n, n) == cols(n, n), 1.0, 0.0).astype(F32)
