"""The GPU form of the `chunked` kernels (in-chunk work batched over all chunks, one scan over the
chunk states: `_chunks_then_states` in gdn.py and gla.py), run on this CPU.

`chunked` picks its form by the platform the program is lowered for (`lax.platform_dependent`);
the `gpu_form` fixture makes that choice always take the non-CPU branch. Each test jits a fresh
closure, so no program traced with the CPU form is reused. A CUDA lowering made here must hold the
GPU form: one scan of T/64 steps whose body does two matrix products (GDN) or one (GLA).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gdn, gla, kgla, linear_attn
from linjax.kernels.contract import expand_kv_heads
from tests.helpers import relative_rms
from tests.kernels.test_gdn import assert_same_run, make_inputs, run_both
from tests.kernels.test_gla import FAST_COMPILE, MECHANISMS, _projected, projections, random_inputs


@pytest.fixture
def gpu_form(monkeypatch):
    """`lax.platform_dependent` answers with its default (non-CPU) branch while the test runs."""
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, default, **_: default(*args))


@pytest.mark.parametrize("per_channel", [True, False], ids=["chan", "scalar"])
def test_gdn_gpu_form_matches_reference(gpu_form, per_channel):
    """T 200 (three chunks of 64 and a padded one), GQA 4:2, initial state."""
    x = make_inputs(11, 200, 2, 32, per_channel=per_channel)
    got, want = run_both(x, kernels=(lambda **a: gdn.chunked(**a), gdn.reference))
    assert_same_run(got, want, tol=1e-5, grad_tol=1e-4)


def test_gdn_gpu_form_hard_resets_and_short_input(gpu_form):
    """log α = −1000 on 5% of the channels; and T 15 < one chunk, without an initial state."""
    x = make_inputs(12, 200, 1, 16)
    reset = jax.random.bernoulli(jax.random.PRNGKey(3), 0.05, x["log_alpha"].shape)
    x["log_alpha"] = jnp.where(reset, -1000.0, x["log_alpha"])
    got, want = run_both(x, kernels=(lambda **a: gdn.chunked(**a), gdn.reference))
    assert_same_run(got, want, tol=1e-5, grad_tol=1e-4)
    x = make_inputs(13, 15, 2, 16, per_channel=False, with_state=False)
    got, want = run_both(x, kernels=(lambda **a: gdn.chunked(**a), gdn.reference))
    assert_same_run(got, want, tol=1e-5, grad_tol=1e-4)


def test_gdn_gpu_form_bf16_inputs(gpu_form):
    x = make_inputs(16, 200, 2, 64, dtype=jnp.bfloat16)
    (o, s, _), = run_both(x, kernels=(lambda **a: gdn.chunked(**a),), grads=False)
    o_ref, s_ref = jax.jit(lambda x: gdn.reference(**{n: a.astype(jnp.float32) for n, a in x.items()}))(x)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert relative_rms(o, o_ref) <= 5e-3 and relative_rms(s, s_ref) <= 5e-3


def compare_gpu_form(mechanism, args, state, *, seed=0, out_tol=1e-5, grad_tol=1e-4):
    """chunked (GPU form) against reference: every output and the gradients of all inputs."""
    module = MECHANISMS[mechanism]
    shapes = [x.shape for x in jax.tree.leaves(
        jax.eval_shape(functools.partial(module.reference, initial_state=state), *args))]
    directions = projections(shapes, seed)

    def both(args, state):
        results = []
        for fn in (lambda *a, **kw: module.chunked(*a, **kw), module.reference):
            grads, outputs = jax.grad(lambda a, s: _projected(fn, a, s, directions), argnums=(0, 1),
                                      has_aux=True)(args, state)
            results.append((outputs, grads))
        return results

    (out_c, grad_c), (out_r, grad_r) = jax.jit(both, compiler_options=FAST_COMPILE)(args, state)
    for c, r in zip(jax.tree.leaves(out_c), jax.tree.leaves(out_r)):
        assert relative_rms(c, r) <= out_tol
    for c, r in zip(jax.tree.leaves(grad_c), jax.tree.leaves(grad_r)):
        assert np.isfinite(np.asarray(c)).all() and relative_rms(c, r) <= grad_tol


@pytest.mark.parametrize("mechanism", ["gla", "kgla", "linear_attn"])
def test_gla_family_gpu_form_matches_reference(gpu_form, mechanism):
    args, state = random_inputs(mechanism, 21, 200, 2, 32)
    compare_gpu_form(mechanism, args, state)


@pytest.mark.parametrize("mechanism", ["gla", "kgla"])
def test_gla_family_gpu_form_hard_resets(gpu_form, mechanism):
    rng = np.random.default_rng(5)
    log_alpha = -np.logaddexp(0.0, -2.0 - rng.standard_normal((2, 150, 4, 16)))
    log_alpha[rng.random(log_alpha.shape) < 0.05] = -1000.0
    args, state = random_inputs(mechanism, 22, 150, 4, 16, log_alpha=log_alpha)
    compare_gpu_form(mechanism, args, state)


# ------------------------------------------------------------ the CPU form is untouched


def test_cpu_lowering_runs_the_cpu_form_exactly():
    """On a CPU, `chunked` (forward and gradients) is bit for bit its CPU form called directly."""
    x = make_inputs(14, 100, 2, 16)

    def cpu_form(q, k, v, log_alpha, beta, initial_state):
        q32, k32, v32, la, b, S0, scale = gdn._prepare(q, k, v, log_alpha, beta, initial_state, None)
        o, S = gdn._chunk_scan(q32, k32, v32, la, b, S0, chunk=gdn.CHUNK)
        return (o * scale).astype(v.dtype), S

    got, want = run_both(x, kernels=(lambda **a: gdn.chunked(**a), lambda **a: cpu_form(**a)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    args, state = random_inputs("gla", 15, 100, 2, 16)

    def gla_cpu_form(q, k, v, log_alpha, initial_state):
        heads = lambda x: expand_kv_heads(x, q.shape[2])
        return gla._chunk_scan(q * q.shape[-1] ** -0.5, heads(k), heads(v), log_alpha, initial_state, gla.CHUNK)

    def value_and_grads(fn):
        return jax.value_and_grad(lambda a: sum(jnp.sum(x ** 2) for x in fn(*a, initial_state=state)))(args)

    public, private = jax.jit(lambda: (value_and_grads(gla.chunked), value_and_grads(gla_cpu_form)))()
    for a, b in zip(jax.tree.leaves(public), jax.tree.leaves(private)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ what a CUDA lowering holds


def _functions(text):
    """{name: body text} of the func.func definitions in a StableHLO module."""
    heads = list(re.finditer(r"func\.func (?:public |private )?@([\w.$-]+)\(", text))
    return {m.group(1): text[m.end():(heads[i + 1].start() if i + 1 < len(heads) else len(text))]
            for i, m in enumerate(heads)}


def _dots(body, functions, seen=()):
    """dot_general ops in `body` and in the functions it calls."""
    calls = set(re.findall(r"func\.call @([\w.$-]+)\(", body)) - set(seen)
    return body.count("stablehlo.dot_general") + sum(_dots(functions[c], functions, (*seen, c)) for c in calls)


def scan_loops(fn, *args):
    """(trip count, dot_general ops per step) of every while loop in fn's CUDA lowering."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    functions = _functions(text)
    loops = []
    for m in re.finditer(r"stablehlo\.while\(", text):
        cond = re.search(r"cond \{(.*?)\} do \{", text[m.end():], re.S)
        trips = int(re.search(r"dense<(\d+)> : tensor<i32>", cond.group(1)).group(1))
        body_start = m.end() + cond.end()
        body = text[body_start:text.index("stablehlo.return", body_start)]
        loops.append((trips, _dots(body, functions)))
    return loops


@pytest.mark.parametrize("mechanism", ["gdn", "gla", "kgla"])
def test_cuda_lowering_holds_the_gpu_form(mechanism):
    """T 256: one scan of 256/64 = 4 steps, forward and backward, whose steps hold only the state
    products (GDN: U = Ũ − WS and the state update; GLA: the update): the in-chunk solve and the
    outputs are outside the loop. The CPU form lowered for CUDA has 8 steps of dozens of products."""
    s = jax.ShapeDtypeStruct
    B, T, H, D = 1, 256, 2, 32
    q = s((B, T, H, D), jnp.bfloat16)
    gates = [s((B, T, H, D), jnp.float32)] + ([s((B, T, H), jnp.float32)] if mechanism != "gla" else [])
    module = {"gdn": gdn, "gla": gla, "kgla": kgla}[mechanism]
    forward = lambda *a: module.chunked(*a)
    loss = lambda *a: jnp.sum(module.chunked(*a)[0].astype(jnp.float32)) + jnp.sum(module.chunked(*a)[1])
    products = 2 if mechanism == "gdn" else 1
    assert scan_loops(forward, q, q, q, *gates) == [(T // gdn.GPU_CHUNK, products)]
    backward = scan_loops(jax.grad(loss, argnums=(0, 1, 2, 3)), q, q, q, *gates)
    assert backward and all(trips == T // gdn.GPU_CHUNK and dots <= 3 * products for trips, dots in backward)


def test_cuda_lowering_of_linear_attn_holds_the_gpu_form():
    q = jax.ShapeDtypeStruct((1, 256, 2, 32), jnp.float32)
    assert scan_loops(lambda *a: linear_attn.chunked(*a), q, q, q) == [(256 // gla.GPU_CHUNK, 1)]
