"""What every Pallas (Triton backend) kernel here shares: input checks, padding to
tiles, BlockSpecs, launch settings, in-kernel matmuls, the per-chunk gate sums
and decayed Gram blocks (and their backward, `diag_pair_grads`) of the GLA and
GDN kernels, forward (gla_pallas.py, gdn_pallas.py) and backward
(gla_pallas_backward.py, gdn_pallas_backward.py), and the custom_vjp that
differentiates a forward-only kernel (SWA's) through its `chunked` twin.

Layout, as in gla_pallas.py and gdn_pallas.py: one program per (batch, query
head, block of Dv columns), looping over chunks with `lax.fori_loop` and
carrying an fp32 state [Dk, BV]. A chunk is cut into 16-token sub-chunks so
the per-channel decay never forms a [C, C, Dk] tensor: an off-diagonal block
(I > J) factorises at the boundary before sub-chunk I, so both factors (decay
from that boundary to i, and from j to it) are ≤ 1, and a diagonal block is
built one column at a time, masking before the exp.

Every exponent is formed as a sum of log α over exactly the steps it spans
(prefix and suffix sums within a sub-chunk, whole sub-chunk totals between),
never as a difference G_i − G_j of two cumulative sums: with a hard reset
(log α ≈ −1000) such a difference loses all precision in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linjax.kernels.contract import check_qkv, check_shape

SUB = 16  # sub-chunk length for the per-channel intra-chunk decay
MAX_BLOCK_V = 64  # Dv columns per program


# ---------------------------------------------------------------- wrapper side


def check_inputs(q, k, v, gate, gate_name: str, initial_state, chunk: int):
    """Raise a readable error for anything outside the kernel contract."""
    B, T, H, _, Dk, Dv = check_qkv(q, k, v)
    if gate is not None:
        check_shape(gate, (B, T, H, Dk), gate_name)
    if initial_state is not None:
        check_shape(initial_state, (B, H, Dk, Dv), "initial_state")
    if chunk <= 0 or chunk % SUB:
        raise ValueError(f"chunk must be a positive multiple of {SUB}; got {chunk}")
    if T == 0:
        raise ValueError("sequence length T must be at least 1")


def tile_size(n: int) -> int:
    """Smallest power of two ≥ max(n, 16): Triton tiles are powers of two and
    its matmuls need sides ≥ 16."""
    return max(16, pl.next_power_of_2(n))


def pad_axis(x, axis: int, size: int, value=0.0):
    """Pad `x` with `value` at the end of `axis` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def head_specs(Tp: int, Dk: int, BV: int, group: int):
    """BlockSpecs on grid (batch, head, Dv block) for the [B, T, H, D] layout.

    Query-head tensors use head h; k and v use kv head h // group (GQA without
    repeating k and v in memory)."""
    sq = pl.squeezed
    return dict(
        q=pl.BlockSpec((sq, Tp, sq, Dk), lambda b, h, j: (b, 0, h, 0)),
        k=pl.BlockSpec((sq, Tp, sq, Dk), lambda b, h, j: (b, 0, h // group, 0)),
        v=pl.BlockSpec((sq, Tp, sq, BV), lambda b, h, j: (b, 0, h // group, j)),
        o=pl.BlockSpec((sq, Tp, sq, BV), lambda b, h, j: (b, 0, h, j)),
        gate=pl.BlockSpec((sq, Tp, sq, Dk), lambda b, h, j: (b, 0, h, 0)),
        per_head=pl.BlockSpec((sq, Tp, sq), lambda b, h, j: (b, 0, h)),
        state=pl.BlockSpec((sq, sq, Dk, BV), lambda b, h, j: (b, h, 0, j)),
    )


def triton_params():
    """Triton launch settings (selecting them is what picks the Triton backend
    over Mosaic GPU). Untuned: no GPU was at hand; 8 warps may suit Dk = 128."""
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


# ------------------------------------------------------------ in-kernel pieces


def load_rows(ref, start, n: int):
    """Rows [start, start + n) of a [T, D] (or [T]) ref, as fp32."""
    return ref[pl.ds(start, n)].astype(jnp.float32)


# Every in-kernel dot runs on fp32 operands at full precision: Triton's lowering otherwise
# uses TF32 (10-bit mantissa) for fp32 dots, which breaks the fp32 tolerances of the tests
# and the reverse cumulative sums of log α (ChunkGates.suffix, a dot with a mask) at hard
# resets (log α ≈ −1000, where TF32 rounding alone is ~1 in absolute terms).
FULL_PRECISION = lax.Precision.HIGHEST


def matmul(a, b):
    return jnp.dot(a, b, precision=FULL_PRECISION, preferred_element_type=jnp.float32)


def matmul_t(a, b):
    """a @ bᵀ."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=FULL_PRECISION,
                           preferred_element_type=jnp.float32)


def t_matmul(a, b):
    """aᵀ @ b."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=FULL_PRECISION,
                           preferred_element_type=jnp.float32)


class ChunkGates:
    """Log decays of one chunk from its raw log α, one [SUB, Dk] block per
    sub-chunk, all as sums of the steps they span (no cancellation):

        prefix[I]  Σ log α over sub-chunk I up to and including row i
        suffix[I]  Σ log α over sub-chunk I after row i
        total[I]   Σ log α over sub-chunk I                           [Dk]
    """

    def __init__(self, log_alpha):
        n = log_alpha[0].shape[0]
        later = jnp.where(lax.broadcasted_iota(jnp.int32, (n, n), 1)
                          > lax.broadcasted_iota(jnp.int32, (n, n), 0), 1.0, 0.0)
        self.log_alpha = log_alpha
        self.prefix = [jnp.cumsum(la, axis=0) for la in log_alpha]
        self.suffix = [matmul(later, la) for la in log_alpha]  # Triton has no reverse cumsum
        self.total = [jnp.sum(la, axis=0) for la in log_alpha]

    def between(self, first: int, stop: int):
        """Σ of the totals of sub-chunks first .. stop − 1 ([Dk]; zeros if none)."""
        out = jnp.zeros_like(self.total[0])
        for m in range(first, stop):
            out = out + self.total[m]
        return out

    def from_start(self, i: int):
        """G of sub-chunk i's rows: log decay from the chunk start ([SUB, Dk])."""
        return self.between(0, i)[None, :] + self.prefix[i]

    def to_end(self, j: int):
        """log decay from sub-chunk j's rows to the chunk end (G_last − G)."""
        return self.suffix[j] + self.between(j + 1, len(self.total))[None, :]

    def whole(self):
        """log decay over the whole chunk (G_last, [Dk])."""
        return self.between(0, len(self.total))


def offdiag_gram(x_i, y_j, gates: ChunkGates, i: int, j: int):
    """Block (I > J) of Σ_d x_id y_jd exp(G_id − G_jd), factorised at the
    boundary before sub-chunk I so that both factors are ≤ 1."""
    to_boundary = gates.suffix[j] + gates.between(j + 1, i)[None, :]
    return matmul_t(x_i * jnp.exp(gates.prefix[i]), y_j * jnp.exp(to_boundary))


def diag_gram(x, y_ref, start, log_alpha, *, strict: bool):
    """Diagonal block: A_ij = Σ_d x_id y_jd exp(Σ_{j<t≤i} log α_td) for j ≤ i
    (j < i if strict), else 0. Built column by column (row j of y read from
    its ref); the exponent of column j is a cumsum of log α over the rows
    after j, so it is ≤ 0 and exact, and masked entries are zeroed."""
    n = x.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def column(j, a):
        y_j = y_ref[start + j].astype(jnp.float32)[None, :]
        keep = rows > j if strict else rows >= j
        decay = jnp.where(keep, jnp.exp(jnp.cumsum(jnp.where(rows > j, log_alpha, 0.0), axis=0)), 0.0)
        col = jnp.sum(x * y_j * decay, axis=1)
        return jnp.where(cols == j, col[:, None], a)

    return lax.fori_loop(0, n, column, jnp.zeros((n, n), jnp.float32))


def diag_pair_grads(x, y_ref, start, log_alpha, w, *, strict: bool):
    """Backward of a diagonal block (`diag_gram`) given the cotangent weights w
    [n, n] of its entries: dx_i = Σ_j w_ij y_j ⊙ d_ij and dy_j = Σ_i w_ij x_i ⊙ d_ij
    with d_ij = exp(Σ_{j<t≤i} log α_t) for j ≤ i (j < i if strict), else 0.
    Built column by column as in `diag_gram` (exponent masked before the exp);
    column j of w is selected with a mask (values cannot be sliced)."""
    n = x.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def column(j, acc):
        dx, dy = acc
        y_j = y_ref[start + j].astype(jnp.float32)[None, :]
        w_j = jnp.sum(jnp.where(cols == j, w, 0.0), axis=1)[:, None]
        keep = rows > j if strict else rows >= j
        decay = jnp.where(keep, jnp.exp(jnp.cumsum(jnp.where(rows > j, log_alpha, 0.0), axis=0)), 0.0)
        weighted = w_j * decay  # [n, Dk]
        dy_j = jnp.sum(weighted * x, axis=0)[None, :]
        return dx + weighted * y_j, jnp.where(rows == j, dy_j, dy)

    zeros = jnp.zeros_like(x)
    return lax.fori_loop(0, n, column, (zeros, zeros))


def pad_to_tiles(q, k, v, log_alpha, initial_state, chunk: int):
    """Pad T to whole chunks (zeros; log α = 0 keeps the state) and Dk, Dv to
    tile sizes (zero channels add nothing). Returns padded (q, k, v,
    log_alpha fp32, initial state fp32, zeros if None). Done outside the
    jitted call so that every T with the same number of chunks shares one
    compiled kernel."""
    B, T, H, Dk = q.shape
    Tp = -(-T // chunk) * chunk
    Dkp, Dvp = tile_size(Dk), tile_size(v.shape[3])

    def prep(x, d):
        return pad_axis(pad_axis(x, 1, Tp), 3, d)

    if initial_state is None:
        h0 = jnp.zeros((B, H, Dkp, Dvp), jnp.float32)
    else:
        h0 = pad_axis(pad_axis(initial_state.astype(jnp.float32), 2, Dkp), 3, Dvp)
    return (prep(q, Dkp), prep(k, Dkp), prep(v, Dvp),
            prep(log_alpha.astype(jnp.float32), Dkp), h0)


# ------------------------------------------------------------ differentiation


def sum_partial_grads(dq, dk, dv, dg, dh0, *, q, k, v, initial_state):
    """The backward kernels' per-program partials -> gradients in the inputs' shapes (fp32):
    dq, dk, dg [n_v, B, Tp, H, Dkp] summed over the Dv blocks, dk and dv [B, T, H, ·] summed over
    the query heads of each kv group, padding cut off; dh0 None without an initial state."""
    (B, T, H, Dk), Hkv, Dv = q.shape, k.shape[2], v.shape[3]
    dq, dk, dg = (x.sum(0)[:, :T, :, :Dk] for x in (dq, dk, dg))
    group_sum = lambda x: x.reshape(B, T, Hkv, H // Hkv, x.shape[-1]).sum(3)
    dk, dv = group_sum(dk), group_sum(dv[:, :T, :, :Dv])
    dh0 = None if initial_state is None else dh0[:, :, :Dk, :Dv].astype(initial_state.dtype)
    return dq, dk, dv, dg, dh0


def with_chunked_backward(kernel_forward, chunked_forward, *arrays):
    """`kernel_forward(*arrays)` with a `jax.custom_vjp` whose backward is the
    VJP of `chunked_forward(*arrays)` (same arguments, same results; entries
    of `arrays` may be None, e.g. no initial state).

    For the forward-only Pallas kernels (SWA; GLA and GDN have their own
    backward kernels): the backward recomputes the forward through the pure-JAX chunked
    implementation and differentiates that. This is exact (both compute the
    same function) but not fast. Static options must already be bound (a lambda or
    functools.partial).
    """

    @jax.custom_vjp
    def run(*arrays):
        return kernel_forward(*arrays)

    def run_fwd(*arrays):
        return run(*arrays), arrays

    def chunked_vjp(arrays, cotangents):
        out, vjp = jax.vjp(chunked_forward, *arrays)
        # Cotangents arrive in the kernel's output dtypes; give the VJP its own.
        return vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangents, out))

    # jit: called eagerly, the backward is one compiled program instead of
    # op-by-op dispatch; under an outer jit it is simply inlined.
    run.defvjp(run_fwd, jax.jit(chunked_vjp))
    return run(*arrays)


def default_interpret(interpret):
    """None → interpret on CPU (where no Triton GPU exists), compile otherwise."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)
