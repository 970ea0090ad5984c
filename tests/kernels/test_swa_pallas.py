"""The sink + window flash kernel (kernels/swa_pallas.py): interpreted forward and input gradients
against swa.reference (fp32 and bf16, T not a multiple of the block, sinks 0 / 8 / 70, windows
5 / 56 / 64 / 128, GQA), kernel outputs that start as NaN and must all be written, the block-sparse
visit counts, and the CUDA lowering made on this CPU: Triton dots with bf16 operands accumulating
in fp32 (IEEE fp32 for fp32 inputs), no T × T array in the forward + backward at T 4,096, and
the rows bench/gpu_check.py takes from swa_pallas_check.check_rows.

Interpret mode compiles are the cost here (seconds per shape), so T stays 130–250 and D 16–32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax._src.pallas.triton.lowering import _new_ir_context

from linjax.kernels import swa, swa_pallas
from linjax.kernels.swa_pallas_check import TOLERANCE, check_rows, compare, random_inputs

H = 4


def assert_within(errors, dtype):
    out_tol, grad_tol = TOLERANCE[dtype]
    assert errors.pop("finite"), "a kernel output or gradient is not finite"
    for name, err in errors.items():
        tol = grad_tol if name.startswith("d") else out_tol
        assert err <= tol, f"{name}: relative RMS {err:.2e} > {tol:.0e} ({errors})"


# (T, kv heads, D, sinks, window, dtype)
CASES = [(200, 2, 16, 8, 56, "float32"), (250, 4, 32, 0, 64, "float32"), (130, 1, 16, 8, 128, "float32"),
         (150, 2, 16, 70, 5, "float32"), (200, 2, 32, 8, 64, "bfloat16"), (250, 1, 16, 0, 56, "bfloat16")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-Hkv{}-D{}-s{}-w{}-{}".format(*c))
def test_parts_and_gradients_match_reference(case):
    """All three SoftmaxParts and dq, dk, dv under random cotangents on all three parts."""
    T, kv_heads, D, sinks, window, dtype = case
    q, k, v, cotangents = random_inputs(T, B=1, T=T, H=H, kv_heads=kv_heads, D=D, dtype=dtype)
    assert_within(compare(q, k, v, cotangents, sinks=sinks, window=window, interpret=True), dtype)


def test_lse_cotangent_reaches_the_inputs():
    """sinks_window_attention's (o, lse) against o and lse formed from the reference's parts, with a
    loss that reads lse (as a combination through the normaliser does)."""
    q, k, v, _ = random_inputs(5, B=1, T=140, H=H, kv_heads=2, D=16, dtype="float32")
    weights = jax.random.normal(jax.random.PRNGKey(6), (1, 140, H))

    def reference(q, k, v):
        parts = swa.reference(q, k, v, sinks=8, window=56)
        return parts.normalized(), parts.row_max + jnp.log(parts.row_sum)

    kernel = lambda q, k, v: swa_pallas.sinks_window_attention(q, k, v, sinks=8, window=56, interpret=True)
    loss = lambda attention: lambda *a: (lambda o, lse: jnp.sum(o[..., 0]) + jnp.sum(weights * lse))(*attention(*a))
    for a, e in zip(jax.jit(kernel)(q, k, v), jax.jit(reference)(q, k, v)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(grads, expected):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sinks", [0, 8])
def test_poisoned_outputs_are_all_written(sinks):
    """Every kernel output, padded rows included, starts as NaN (ints −1) and comes back finite."""
    T, Tp, D = 150, 192, 16
    q, k, v, _ = random_inputs(7, B=1, T=T, H=H, kv_heads=2, D=D, dtype="float32")
    q, k, v = (jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) for x in (q, k, v))
    cfg = swa_pallas._Config(sinks=sinks, window=56, scale=0.25, block=64, group=2, interpret=True, poison=True)
    o, lse, row_max, arg = jax.jit(swa_pallas._forward, static_argnums=3)(q, k, v, cfg)
    assert (arg >= 0).all() and (arg <= jnp.arange(Tp)[None, :, None]).all()
    rows = jax.random.normal(jax.random.PRNGKey(8), (3, 1, Tp, H))
    outputs = jax.jit(swa_pallas._backward, static_argnums=8)(q, k, v, o, lse, rows[0], rows[1], arg, cfg)
    assert (outputs[3] is None) == (sinks == 0)
    for x in (o, lse, row_max, *(x for x in outputs if x is not None)):
        assert jnp.isfinite(x).all()


@pytest.mark.parametrize("window", [1, 5, 56, 64, 65, 128, 300])
def test_block_sparse_visits(window):
    """A query block of 64 visits ⌈(64 + window − 1)/64⌉ + 1 window key blocks at most (two for
    window ≤ 64), and the dk/dv program of a key block as many query blocks."""
    cfg = swa_pallas._Config(sinks=8, window=window, scale=1.0, block=64, group=1, interpret=True, poison=False)
    bound = -(-(64 + window - 1) // 64) + 1
    n_blocks = 40
    for i in range(n_blocks):
        first = int(swa_pallas._first_window_block(i * 64, cfg))
        assert i + 1 - first <= (2 if window <= 64 else bound)
        # the dk/dv program's query range, as in _dkdv_kernel
        last = min((i * 64 + 63 + window - 1) // 64, n_blocks - 1)
        assert last + 1 - i <= bound


# -------------------------------------------------------------- CUDA lowering

TRITON_CALL = "__gpu$xla.gpu.triton"


def exported_text(fn, *args):
    exported = export.export(jax.jit(fn), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


def triton_modules(text):
    """{kernel name: Triton IR text} of every Triton call in an exported StableHLO module."""
    modules = {}
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        calls = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "stablehlo.custom_call":
                            calls.append(inner.operation.attributes["mhlo.backend_config"])
                        walk(inner.operation)

        walk(module.operation)
        blobs = [(ir.StringAttr(c["name"]).value, ir.StringAttr(c["ir"]).value_bytes) for c in calls]
    for name, blob in blobs:
        with _new_ir_context():
            modules[name] = str(ir.Module.parse(blob))
    return modules


def shapes(T, dtype, D=64):
    s = jax.ShapeDtypeStruct
    return s((1, T, H, D), dtype), s((1, T, 2, D), dtype), s((1, T, 2, D), dtype)


def loss(*args):
    return sum(jnp.sum(x) for x in swa.pallas(*args, sinks=8, window=56, interpret=False))


DOT = re.compile(r"tt\.dot .*: tensor<(\d+)x(\d+)x(\w+)> \* tensor<(\d+)x(\d+)x(\w+)> -> tensor<(\d+)x(\d+)x(\w+)>")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_and_backward_lower_with_the_intended_dot_precision(dtype):
    """value_and_grad lowers to the three kernels; every dot takes the input dtype and accumulates
    in fp32, and fp32 dots are IEEE (no `inputPrecision = tf32`, which Triton prints when asked)."""
    text = exported_text(jax.value_and_grad(loss, argnums=(0, 1, 2)), *shapes(200, jnp.dtype(dtype)))
    modules = triton_modules(text)
    assert sorted(modules) == ["linjax_swa_sinks_bwd_dkdv", "linjax_swa_sinks_bwd_dq", "linjax_swa_sinks_fwd"]
    operand = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    for name, triton_ir in modules.items():
        dots = [line for line in triton_ir.splitlines() if "tt.dot " in line]
        assert dots, name
        for line in dots:
            *_, a, _, _, b, _, _, acc = DOT.search(line).groups()
            assert (a, b, acc) == (operand, operand, "f32"), (name, line)
            assert "tf32" not in line, (name, line)


def tensors_of_at_least(text, elements):
    """The tensor types in a StableHLO text with at least `elements` elements."""
    found = []
    for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text):
        if int(np.prod([int(d) for d in dims.rstrip("x").split("x")])) >= elements:
            found.append(dims)
    return found


def test_no_t_by_t_array_at_4096():
    """Forward + backward at T 4,096 lowered for CUDA hold nothing with T² elements (the dense
    reference, lowered the same way, does: the check can fail)."""
    T = 4096
    args = shapes(T, jnp.bfloat16)
    text = exported_text(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    assert not tensors_of_at_least(text, T * T)
    for triton_ir in triton_modules(text).values():
        assert not tensors_of_at_least(triton_ir, T * T)
    dense = lambda *a: sum(jnp.sum(x) for x in swa.reference(*a, sinks=8, window=56))
    assert tensors_of_at_least(exported_text(jax.grad(dense, argnums=(0, 1, 2)), *args), T * T)


def test_check_rows_for_the_gpu_check():
    rows = check_rows(B=1, T=70, H=2, D=16, interpret=True, cases=[(8, 56, 1)], dtypes=("bfloat16",))
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["dtype"] == "bfloat16", rows
