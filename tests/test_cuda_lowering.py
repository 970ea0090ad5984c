"""The programs a GPU runs, lowered for CUDA on this CPU machine: no T × T array per head.

The training step of the final recipe and the floor (loss + gradient to the input embeddings of
the frozen model), at T 4,096 with the GPU's memory policy (each layer recomputed in the backward,
the loss over 1,024-position pieces), lowered with `lowering_platforms=("cuda",)`: every tensor in
the StableHLO text is checked for a T × T shape. XLA's `dot_product_attention` keeps the whole
[B, H, T, T] probabilities for its backward (67 GB at SmolLM2's shapes and batch 4), which is
what ran out of memory on an H100.

The branch a program holds must follow the platform it is lowered for, not the machine that
lowers it: each lowering is made twice, once as this machine is and once with
`jax.default_backend()` answering "gpu" (what it says on a GPU machine), and the two must be
the same program.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.experiment import REMAT_POLICY, TrainSection
from linjax.model import CausalLM
from linjax.train import sharding
from linjax.train.loop import make_optimizer, make_train_step, place_train_state
from linjax.train.objectives import embedding_floor_loss

T = 4096
GPU_POLICY = dict(remat=REMAT_POLICY["full"], loss_chunk=1024)
FINAL_RECIPE = dict(mechanism="gdn", window=56, sinks=8, adapter="shortconv")
TENSOR = re.compile(r"tensor<((?:\d+x)+)[a-z]")


def square_tensors(text: str, length: int) -> list[str]:
    """Tensor types in StableHLO `text` with two axes of at least length − 1, or as many elements
    as a (length − 1)² matrix: a score or probability matrix over the whole sequence."""
    found = set()
    for dims in TENSOR.findall(text):
        shape = [int(d) for d in dims.rstrip("x").split("x")]
        if sum(d >= length - 1 for d in shape) >= 2 or np.prod(shape, dtype=np.int64) >= (length - 1) ** 2:
            found.add("x".join(map(str, shape)))
    return sorted(found)


def base_model(dtype):
    config = tiny_config("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, hidden_size=128)
    return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))


def floor_program(dtype):
    base = base_model(dtype)
    graphdef, params = nnx.split(base)

    def floor(params, tokens):
        model = nnx.merge(graphdef, params)
        model.remat = GPU_POLICY["remat"]
        embeddings = model.embed_tokens(tokens)
        return jax.grad(lambda e: embedding_floor_loss(model, e, tokens, GPU_POLICY["loss_chunk"]))(embeddings)

    return jax.jit(floor), (params, jax.ShapeDtypeStruct((1, T), jnp.int32))


def train_step_program(dtype, kernel):
    model = linjax.linearize(base_model(dtype), linjax.LinearizeConfig(**FINAL_RECIPE, kernel=kernel), seed=1)
    mesh = sharding.make_mesh()
    optimizer, _ = make_optimizer(TrainSection(steps=10, seq_len=T, warmup_steps=1), "shortconv")
    graphdef, trainable, opt_state, frozen, _ = place_train_state(model, optimizer, mesh)
    step = make_train_step(graphdef, optimizer, "ce", mesh, **GPU_POLICY)
    return step, (trainable, opt_state, frozen, jax.ShapeDtypeStruct((1, T), jnp.int32))


def cuda_text(program, args) -> str:
    return program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lowered_as_on_a_gpu(monkeypatch, build):
    """(the CUDA lowering made as this machine is, the same with jax.default_backend() saying "gpu")."""
    here = cuda_text(*build())
    with monkeypatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        as_on_gpu = cuda_text(*build())
    return here, as_on_gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_floor_lowered_for_cuda_keeps_no_sequence_square(monkeypatch, dtype):
    here, as_on_gpu = lowered_as_on_a_gpu(monkeypatch, lambda: floor_program(jnp.dtype(dtype)))
    assert square_tensors(here, T) == [] and square_tensors(as_on_gpu, T) == []
    assert here == as_on_gpu


@pytest.mark.parametrize("kernel", ["chunked", "pallas"])
def test_the_final_recipe_step_lowered_for_cuda_keeps_no_sequence_square(monkeypatch, kernel):
    here, as_on_gpu = lowered_as_on_a_gpu(monkeypatch, lambda: train_step_program(jnp.bfloat16, kernel))
    assert square_tensors(here, T) == [] and square_tensors(as_on_gpu, T) == []
    assert here == as_on_gpu
    # The Pallas kernels follow the lowering platform: a CUDA lowering made here holds their Triton calls.
    assert ("__gpu$xla.gpu.triton" in here) == (kernel == "pallas")


def test_square_tensors_finds_a_score_matrix():
    assert square_tensors("tensor<1x4x4096x4096xf32> tensor<1x4096x64xbf16>", 4096) == ["1x4x4096x4096"]
    assert square_tensors("tensor<30x3x4x3x4095x4095xf32>", 4096) == ["30x3x4x3x4095x4095"]
    assert square_tensors("tensor<1x2x512x4096xf32> tensor<4096xi32>", 4096) == []


def test_auto_settings_resolve_for_the_platform_being_built_for():
    """`compiling_for("cuda")` gives the GPU's "auto" settings on a machine without a GPU (and a CUDA
    lowering made inside it is the program a GPU runs); outside it they follow this process's devices."""
    from linjax.experiment import ModelSection
    from linjax.platform import compiling_for, has_cuda, resolve_kernel

    with compiling_for("cuda"):
        assert resolve_kernel("auto") == "pallas" and ModelSection().dtype == "bfloat16"
        assert TrainSection(steps=10, seq_len=T, warmup_steps=1).remat_policy() == REMAT_POLICY["full"]
        assert TrainSection(steps=10, seq_len=T, warmup_steps=1).loss_chunk_size() == GPU_POLICY["loss_chunk"]
        with compiling_for("cpu"):
            assert resolve_kernel("auto") == "chunked" and ModelSection().dtype == "float32"
    assert resolve_kernel("auto") == ("pallas" if has_cuda() else "chunked")
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"), compiling_for("gpu"):
        pass
