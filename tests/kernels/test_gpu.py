"""The Pallas kernels compiled for a GPU (Triton), not interpreted, against each mechanism's
`reference` recurrence: outputs, final states and gradients in fp32 and bf16, at the shapes
training uses (T not a multiple of the chunk, GQA, head dims 64 and 128), and a linearized
model whose blocks run in Pallas against the same model on the XLA chunked kernels.

These tests skip where JAX has no GPU backend (every CPU machine, CI included). On a GPU
machine, `python bench/gpu_check.py` runs them (docs/gpu.md), or alone:

    python -m pytest -q -m gpu tests/kernels/test_gpu.py      # -n 4 with pytest-xdist

`test_input_gradients_match_reference` draws fresh inputs each run (the seed is in its
failure message; LINJAX_GPU_CHECK_SEED fixes it).

The fp32 tolerances assume dots at about fp32's accuracy: inside the Pallas kernels (fp32 operands as
TF32×3 in the chunked kernels, chunk_pallas.py, and IEEE fp32 in swa_pallas.py), and in the XLA code
around them and in `reference`, which on a GPU run fp32 dots as TF32 unless told otherwise: every test
here runs under `jax.default_matmul_precision("highest")` (on the first H100 run, without it, every fp32
case failed and every bf16 case passed). The mechanism grids read the mixer registry
(`linjax.linearize.LINEAR_MIXERS`): a new mechanism's kernels are tested here without an edit.
"""

from __future__ import annotations

import os
import random

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.kernels import gdn, gla, kgla, linear_attn, swa
from linjax.linearize import LINEAR_MIXERS
from linjax.model import CausalLM
from tests.helpers import linear_mechanisms, relative_rms
from tests.kernels.test_pallas import (
    KERNEL_BACKWARD,
    TOL,
    assert_close,
    check_grads_per_input,
    check_vjp,
    gla_gates,
    make_inputs,
)
from tests.test_linearize import tokens_for

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU (JAX's gpu backend)")]

# (T, Hkv, D, with initial state): T spans several chunks and ends mid-chunk; H = 4 query heads.
SHAPES = [(1000, 2, 128, False), (333, 4, 64, True), (1, 1, 64, True)]
shape_id = lambda c: "T{}-Hkv{}-D{}-{}".format(c[0], c[1], c[2], "h0" if c[3] else "noh0")
reference = {m.__name__.rsplit(".", 1)[-1]: jax.jit(m.reference) for m in (gla, gdn, kgla, linear_attn)}
compiled = dict(interpret=False)
FRESH_SEED = int(os.environ.get("LINJAX_GPU_CHECK_SEED") or random.SystemRandom().randrange(1 << 30))
# Relative RMS against the fp32 reference on the same (rounded) inputs: bf16 operands carry
# ~3 significant digits, and a chunked form's sums round differently from the recurrence's.
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
FORWARD_TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def full_precision_fp32_dots():
    """XLA on a GPU runs fp32 dots as TF32 by default (about 3 significant digits): the reference
    and the kernels' XLA parts at full precision, so the fp32 tolerances measure the kernels."""
    with jax.default_matmul_precision("highest"):
        yield


def kernel_case(mech, dtype, seed):
    """(Pallas function, reference function, inputs) for one mechanism: T 333 (not a multiple of
    any chunk), GQA (H 4 over Hkv 2), D 64, the registry's inputs and an initial state for the linear
    kernels; every 50th step of the GDN case is a hard reset (log α = −1000)."""
    up = lambda xs: [x.astype(jnp.float32) if x is not None else None for x in xs]  # noqa: E731
    if mech == "swa":
        q, k, v, _, _, _ = make_inputs(seed, 333, 2, 64, True, dtype)
        kernel = lambda q, k, v: swa.pallas(q, k, v, sinks=8, window=56, **compiled)  # noqa: E731
        spec = lambda q, k, v: swa.reference(*up((q, k, v)), sinks=8, window=56)  # noqa: E731
        return kernel, spec, (q, k, v)
    mixer = LINEAR_MIXERS[mech]
    q, k, v, *gates = mixer.example_inputs(jax.random.key(seed), 2, 333, 4, 2, 64, jnp.dtype(dtype))
    if mech == "gdn":
        gates[0] = gates[0].at[:, ::50].set(-1000.0)
    module = mixer.kernel_module
    state = jax.eval_shape(module.reference, q, k, v, *gates)[1]
    h0 = jnp.abs(jax.random.normal(jax.random.key(seed + 2), state.shape))
    n = 3 + len(gates)
    kernel = lambda *a: module.pallas(*a[:n], initial_state=a[n], **compiled)  # noqa: E731
    spec = lambda *a: module.reference(*up(a[:n]), initial_state=a[n])  # noqa: E731
    return kernel, spec, (q, k, v, *gates, h0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mech", linear_mechanisms())
def test_linear_kernels_forward(mech, shape, dtype):
    """Each mechanism's kernel on its registry inputs (its feature map, gates in a trained range)."""
    T, Hkv, D, with_state = shape
    mixer = LINEAR_MIXERS[mech]
    q, k, v, *gates = mixer.example_inputs(jax.random.key(21), 2, T, 4, Hkv, D, jnp.dtype(dtype))
    state = jax.eval_shape(lambda: mixer.kernel_module.reference(q, k, v, *gates))[1]
    # Positive, as a state of positive features is (Hedgehog's normaliser must not cross zero).
    h0 = jnp.abs(jax.random.normal(jax.random.key(22), state.shape)) if with_state else None
    module = mixer.kernel_module
    assert_close(module.pallas(q, k, v, *gates, initial_state=h0, **compiled),
                 jax.jit(module.reference)(q, k, v, *gates, initial_state=h0), TOL[dtype], mech)


@pytest.mark.parametrize("gates", ["spread", "resets"])
@pytest.mark.parametrize("mech", ["gla", "gdn"])
def test_extreme_gates(mech, gates):
    q, k, v, log_alpha, beta, h0 = make_inputs(22, 500, 2, 64, True, "float32", unit_keys=True, gate_spread=8.0)
    if gates == "resets":
        log_alpha = log_alpha.at[:, ::8].set(-1000.0)
    module, args = (gla, (log_alpha,)) if mech == "gla" else (gdn, (log_alpha, beta))
    assert_close(module.pallas(q, k, v, *args, initial_state=h0, **compiled),
                 reference[mech](q, k, v, *args, initial_state=h0), TOL["float32"], mech)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sinks, window", [(8, 56), (0, 64), (70, 5)])
def test_swa_forward(sinks, window, dtype):
    q, k, v, _, _, _ = make_inputs(24, 1000, 2, 128, False, dtype)
    assert_close(swa.pallas(q, k, v, sinks=sinks, window=window, **compiled),
                 jax.jit(swa.reference, static_argnames=("sinks", "window"))(q, k, v, sinks=sinks, window=window),
                 TOL[dtype])


@pytest.mark.parametrize("mech", ["gla", "gdn"])
def test_gradients(mech):
    q, k, v, log_alpha, beta, h0 = make_inputs(25, 333, 2, 64, True, "float32", unit_keys=True)
    module, gates = (gla, (log_alpha,)) if mech == "gla" else (gdn, (log_alpha, beta))
    n = 3 + len(gates)
    kernel = lambda *a: module.pallas(*a[:n], initial_state=a[n], **compiled)
    spec = lambda *a: module.reference(*a[:n], initial_state=a[n])
    check_vjp(kernel, spec, (q, k, v, *gates, h0), 26)  # relative RMS ≤ 1e-4 on every gradient


@pytest.mark.parametrize("case", [(333, 2, 128, True, "smooth"), *KERNEL_BACKWARD[1:2]],
                         ids=lambda c: "T{}-Hkv{}-D{}-h0{}-{}".format(*c))
@pytest.mark.parametrize("mech", ["gla", "gdn"])
def test_backward_kernels_match_chunked(mech, case):
    """The compiled GLA / GDN backward kernels against autodiff through `chunked`, input by
    input (relative RMS ≤ 1e-5), with hard resets in the second case."""
    T, Hkv, D, with_state, gates = case
    q, k, v, log_alpha, beta, h0 = make_inputs(27, T, Hkv, D, with_state, "float32", unit_keys=True)
    module, gates = (gla, (gla_gates(log_alpha, gates),)) if mech == "gla" else \
        (gdn, (gla_gates(log_alpha, gates), beta))
    n = 3 + len(gates)
    fn = lambda f, **kw: lambda *a: f(*a[:n], initial_state=a[n], **kw)
    check_grads_per_input(fn(module.pallas, **compiled), fn(module.chunked), (q, k, v, *gates, h0), 28)


@pytest.mark.parametrize("mechanism", linear_mechanisms())
def test_linearized_model_on_pallas_matches_chunked(mechanism):
    base = CausalLM(tiny_config("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, hidden_size=256), rngs=nnx.Rngs(3))
    settings = dict(mechanism=mechanism, window=56, sinks=8, adapter="shortconv")
    chunked = linjax.linearize(base, linjax.LinearizeConfig(**settings, kernel="chunked"), seed=1)
    on_pallas = linjax.linearize(base, linjax.LinearizeConfig(**settings, kernel="pallas"), seed=1)
    tokens = tokens_for(base, 300, seed=7)
    run = lambda model: nnx.jit(lambda m, t: m(t))(model, tokens)
    assert relative_rms(run(on_pallas), run(chunked)) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mech", [*linear_mechanisms(), "swa"])
def test_input_gradients_match_reference(mech, dtype):
    """Outputs and the gradient of every input, compiled Pallas against the fp32 reference, on
    fresh random inputs and cotangents."""
    kernel, spec, args = kernel_case(mech, dtype, FRESH_SEED)
    out = jax.eval_shape(spec, *args)
    keys = jax.random.split(jax.random.key(FRESH_SEED + 1), len(jax.tree.leaves(out)))
    cotangent = jax.tree.unflatten(jax.tree.structure(out), [
        jax.random.normal(key, o.shape, jnp.float32) for key, o in zip(keys, jax.tree.leaves(out))])
    pullback = lambda f: jax.jit(lambda a, ct: (lambda o, vjp: (o, vjp(  # noqa: E731
        jax.tree.map(lambda c, x: c.astype(x.dtype), ct, o))))(*jax.vjp(f, *a)))
    got_out, got = pullback(kernel)(args, cotangent)
    want_out, want = pullback(spec)(args, cotangent)
    where = f"{mech} {dtype} seed {FRESH_SEED}"
    assert_close(got_out, want_out, FORWARD_TOL[dtype], where)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        err = relative_rms(g, w)
        assert err <= GRAD_TOL[dtype], f"{where}: gradient of input {i}: relative RMS {err:.2e} > {GRAD_TOL[dtype]:.0e}"
