"""GLA kernels: chunked and step against the reference scan, and the reference against FLA's naive GLA.

The harness here (`random_inputs`, `compare_chunked`, `compare_step`) is
shared with test_kgla.py and test_linear_attn.py. Each comparison is one
jitted call per shape that returns outputs, final states and the gradients
of a random projection of them, for both implementations; XLA's expensive
CPU passes are switched off for these calls (compile time dominates here).
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gla, kgla, linear_attn
from tests.helpers import relative_rms
from tests.kernels.fla_oracle import fla_naive

MECHANISMS = {"gla": gla, "kgla": kgla, "linear_attn": linear_attn}
FAST_COMPILE = {"xla_llvm_disable_expensive_passes": True}  # not optimization level 0: it hung now and then
B, H = 2, 4
GRID = list(itertools.product([1, 15, 64, 200], [1, 2, 4], [16, 64], [True, False]))
GRID_IDS = [f"T{T}-Hkv{Hkv}-D{D}-{'init' if init else 'noinit'}" for T, Hkv, D, init in GRID]
# kGLA and linear attention run the same chunk kernel as GLA (gla.chunked_scan), which the full GRID
# covers; for them every T × init pair runs once, with (Hkv, D) cycling so each of the six pairs appears.
_HKV_D = list(itertools.product([1, 2, 4], [16, 64]))
REDUCED_GRID = [(T, *_HKV_D[i % 6], init) for i, (T, init) in
                enumerate(itertools.product([1, 15, 64, 200], [True, False]))]
if os.environ.get("LINJAX_FULL_GRID") == "1":  # the full product for them too (as for GDN)
    REDUCED_GRID = GRID
REDUCED_IDS = [f"T{T}-Hkv{Hkv}-D{D}-{'init' if init else 'noinit'}" for T, Hkv, D, init in REDUCED_GRID]


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_inputs(mechanism, seed, T, Hkv, D, *, init=True, batch=B, heads=H, log_alpha=None, beta=None):
    """(args, initial_state): args = (q, k, v, *gates) as the mechanism takes them, fp32.

    GLA: log α = LogSigmoid(N(2, 1)) as the paper's gate. kGLA: the same, L2-normalised
    keys and β = sigmoid(N(0, 1)). Linear attention: positive softmax features for q, k.
    Drawn with numpy (a jax.random call per new shape would compile).
    """
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = normal(batch, T, heads, D), normal(batch, T, Hkv, D), normal(batch, T, Hkv, D)
    if log_alpha is None:
        log_alpha = _log_sigmoid(2.0 + normal(batch, T, heads, D))
    if mechanism == "gla":
        args = (q, k, v, log_alpha)
    elif mechanism == "kgla":
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        if beta is None:
            beta = 1.0 / (1.0 + np.exp(-normal(batch, T, heads)))
        args = (q, k, v, log_alpha, beta)
    else:
        args = (_softmax(q), _softmax(k), v)
    state = 0.5 * normal(batch, heads, D, D) if init else None
    if init and mechanism == "linear_attn":  # [S, z] with z a sum of positive features, as a real prefix gives
        z = rng.uniform(0.5, 2.0, (batch, heads, D, 1)).astype(np.float32)
        state = np.concatenate([state, z], axis=-1)
    as_jax = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    return tuple(map(as_jax, args)), as_jax(state)


def projections(outputs_shapes, seed):
    """Fixed random directions (numpy) for the scalar loss Σ_i ⟨P_i, output_i⟩."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for shape in outputs_shapes)


def first_output(result):
    """o of a kernel's (o, state) result (linear_attn's o is a NormalizedOutput that also carries its normaliser)."""
    return jax.tree.leaves(result[0])[0]


def _projected(fn, args, state, directions):
    """Σ_i ⟨P_i, output_i⟩ over all outputs (o[, normaliser], final state)."""
    outputs = fn(*args, initial_state=state)
    return sum((out.astype(jnp.float32) * p).sum() for out, p in zip(jax.tree.leaves(outputs), directions)), outputs


@functools.partial(jax.jit, static_argnames=("mechanism", "chunk", "options"), compiler_options=FAST_COMPILE)
def chunked_and_reference(mechanism, args, state, directions, chunk=64, options=()):
    """((outputs, grads) of chunked, (outputs, grads) of reference); grads wrt args and the state (if given).
    `options`: extra keyword arguments for both, as ((name, value), ...)."""
    module = MECHANISMS[mechanism]
    results = []
    for fn in (functools.partial(module.chunked, chunk=chunk, **dict(options)),
               functools.partial(module.reference, **dict(options))):
        grad_fn = jax.grad(lambda a, s: _projected(fn, a, s, directions), argnums=(0, 1) if state is not None else 0,
                           has_aux=True)
        grads, outputs = grad_fn(args, state)
        results.append((outputs, grads))
    return results


def compare_chunked(mechanism, args, state, *, chunk=64, seed=0, out_tol=1e-5, grad_tol=1e-4, grads=True,
                    options=()):
    """Assert chunked ≈ reference for every output and gradient; returns the worst errors (out, grad)."""
    module = MECHANISMS[mechanism]
    shapes = [x.shape for x in jax.tree.leaves(
        jax.eval_shape(functools.partial(module.reference, initial_state=state), *args))]
    (out_c, grad_c), (out_r, grad_r) = chunked_and_reference(mechanism, args, state, projections(shapes, seed),
                                                             chunk=chunk, options=options)
    out_err = max(relative_rms(c, r) for c, r in zip(jax.tree.leaves(out_c), jax.tree.leaves(out_r)))
    grad_err = max(relative_rms(c, r) for c, r in zip(jax.tree.leaves(grad_c), jax.tree.leaves(grad_r)))
    for x in jax.tree.leaves((out_c, grad_c)):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    assert out_err <= out_tol, f"outputs/states: relative RMS {out_err:.2e} > {out_tol}"
    if grads:
        assert grad_err <= grad_tol, f"gradients: relative RMS {grad_err:.2e} > {grad_tol}"
    return out_err, grad_err


@functools.partial(jax.jit, static_argnames=("mechanism",), compiler_options=FAST_COMPILE)
def stepped(mechanism, args, state):
    """Run `step` token by token (lax.scan over time), returning (per-token outputs..., final state)."""
    module = MECHANISMS[mechanism]

    def one_token(S, xs):
        out = module.step(*xs, state=S)
        return out[1], tuple(jax.tree.leaves(out[0]))

    state, per_token = jax.lax.scan(one_token, state, tuple(jnp.swapaxes(x, 0, 1) for x in args))
    return tuple(jnp.swapaxes(x, 0, 1) for x in per_token), state


def compare_step(mechanism, args, state, tol=1e-5):
    (o, *extra), final = stepped(mechanism, args, state)
    ref = MECHANISMS[mechanism].reference(*args, initial_state=state)
    ref_o, *ref_extra = jax.tree.leaves(ref[0])
    errs = [relative_rms(o, ref_o), relative_rms(final, ref[1])] + [relative_rms(e, r) for e, r in
                                                                     zip(extra, ref_extra)]
    assert max(errs) <= tol, errs


@functools.partial(jax.jit, static_argnames=("mechanism", "split"), compiler_options=FAST_COMPILE)
def _split_and_whole(mechanism, args, state, split):
    chunked = MECHANISMS[mechanism].chunked
    whole = chunked(*args, initial_state=state)
    first = chunked(*(x[:, :split] for x in args), initial_state=state)
    second = chunked(*(x[:, split:] for x in args), initial_state=first[1])
    return whole, first, second


def compare_split(mechanism, args, state, split):
    """Running [0, split) then [split, T) from the carried state equals one pass."""
    whole, first, second = _split_and_whole(mechanism, args, state, split)
    assert relative_rms(jnp.concatenate([first_output(first), first_output(second)], axis=1),
                        first_output(whole)) <= 1e-5
    assert relative_rms(second[1], whole[1]) <= 1e-5


@functools.partial(jax.jit, static_argnames=("mechanism",), compiler_options=FAST_COMPILE)
def _bf16_and_reference(mechanism, args, state):
    module = MECHANISMS[mechanism]
    low = tuple(x.astype(jnp.bfloat16) for x in args)
    return module.chunked(*low, initial_state=state), module.reference(*(x.astype(jnp.float32) for x in low),
                                                                       initial_state=state)


def compare_bf16(mechanism, args, state, tol=5e-3):
    """bf16 inputs through chunked vs the fp32 reference on the same (rounded) values; output dtype is bf16."""
    out, ref = _bf16_and_reference(mechanism, args, state)
    assert first_output(out).dtype == jnp.bfloat16 and out[1].dtype == jnp.float32
    assert relative_rms(first_output(out), first_output(ref)) <= tol and relative_rms(out[1], ref[1]) <= tol


# ------------------------------------------------------------------------ tests


@pytest.mark.parametrize("T, Hkv, D, init", GRID, ids=GRID_IDS)
def test_chunked_matches_reference(T, Hkv, D, init):
    args, state = random_inputs("gla", T * 131 + Hkv * 7 + D, T, Hkv, D, init=init)
    compare_chunked("gla", args, state, seed=T + D)


@pytest.mark.parametrize("chunk", [16, 128])
def test_other_chunk_sizes(chunk):
    args, state = random_inputs("gla", chunk, 150, 2, 16)
    compare_chunked("gla", args, state, chunk=chunk)


@pytest.mark.parametrize("T, Hkv", [(15, 2), (70, 4)])
def test_step_matches_reference(T, Hkv):
    args, state = random_inputs("gla", 3 + T, T, Hkv, 16)
    compare_step("gla", args, state)


@pytest.mark.parametrize("split", [1, 130])
def test_split_sequence_equals_one_pass(split):
    args, state = random_inputs("gla", split, 200, 2, 16)
    compare_split("gla", args, state, split)


@pytest.mark.parametrize("T, init", [(15, False), (200, True)])
def test_bf16_inputs(T, init):
    args, state = random_inputs("gla", 11 + T, T, 2, 64, init=init)
    compare_bf16("gla", args, state)


def _extreme_gates(kind, seed, T, D):
    rng = np.random.default_rng(seed)
    if kind == "hard":  # every step between −20 and −1000 (near-resets everywhere)
        return -rng.uniform(20.0, 1000.0, (B, T, H, D))
    # mild gates with 5% hard resets: exponents that mix −1000 and −0.01 inside one chunk
    mild = -rng.uniform(0.0, 0.05, (B, T, H, D))
    return np.where(rng.uniform(size=(B, T, H, D)) < 0.05, -1000.0, mild)


@pytest.mark.parametrize("kind", ["hard", "resets"])
def test_extreme_gates_stay_finite_and_exact(kind):
    T, D = 200, 16
    args, state = random_inputs("gla", 9, T, 2, D, log_alpha=_extreme_gates(kind, 1, T, D))
    q, k, v, g = args
    base = np.random.default_rng(5).standard_normal((1, 1, 2, D), dtype=np.float32)
    nearly_parallel = base + 1e-3 * k  # keys that all point the same way
    compare_chunked("gla", (q, nearly_parallel, v, g), state, out_tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_matches_fla_naive_gla(dtype):
    naive = fla_naive("gla")  # skips, or fails in CI, without torch and fla-core
    import torch
    T, Hkv, D = 70, 2, 16
    (q, k, v, g), state = random_inputs("gla", 21, T, Hkv, D)
    o, final = gla.reference(q, k, v, g, initial_state=state)
    t = lambda x: torch.tensor(np.asarray(x), dtype=getattr(torch, dtype))
    # FLA's naive GLA has no GQA: each kv head repeated for its H // Hkv consecutive query heads, as HF's
    # repeat_kv does (numpy here, not linjax's own expand_kv_heads, so the oracle stays independent).
    rep = lambda x: np.repeat(np.asarray(x), H // Hkv, axis=2)
    o_fla, final_fla = naive.naive_recurrent_gla(t(q), t(rep(k)), t(rep(v)), t(g), initial_state=t(state),
                                                 output_final_state=True)
    assert relative_rms(o, o_fla.numpy()) <= 1e-5
    assert relative_rms(final, final_fla.numpy()) <= 1e-5


def test_bad_inputs_raise_readable_errors():
    (q, k, v, g), _ = random_inputs("gla", 0, 8, 3, 16, heads=4)  # 4 query heads, 3 kv heads
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        gla.chunked(q, k, v, g)
    (q, k, v, g), _ = random_inputs("gla", 0, 8, 2, 16)
    with pytest.raises(ValueError, match=r"batch, time, heads, dim"):
        gla.reference(q[0], k, v, g)
    with pytest.raises(ValueError, match="log_alpha"):
        gla.chunked(q, k, v, g[..., :8])
    with pytest.raises(ValueError, match="initial_state"):
        gla.chunked(q, k, v, g, initial_state=jnp.zeros((B, H, 16, 8)))
    with pytest.raises(ValueError, match="without a time axis"):
        gla.step(q, k, v, g)
