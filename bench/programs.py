"""The GPU programs linjax is judged by, defined once for the deviceless compile (bench/compile_gpu.py)
and the timed check on a card (bench/gpu_check.py): the same functions at the same shapes, so that
what the CPU machine predicts can be compared with what the card measures.

    MODELS                                   shapes of SmolLM2-135M, Llama-3.1-8B and a tiny model
    KERNELS                                  every linear mechanism of linjax's registry, and sinks + window
    kernel_inputs(mech, B, T, H, D, dtype, key=None) -> its kernel's arguments
    kernel_program(mech, form, backward) -> a function of them
    train_step_program(model, batch, T, what, mesh, *, abstract, ...) -> (jitted step, arguments)

With key=None / abstract=True the arguments are ShapeDtypeStructs (nothing is allocated: an 8B
model's step is built from shapes alone); otherwise random arrays on the mesh's devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                         rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                         rope_original_max_position_embeddings=8192, max_position_embeddings=131072),
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                 tie_word_embeddings=True),
}
# The paper's final recipe: GDN + sliding window 56 + 8 sinks + short conv, trained by cross-entropy.
FINAL_RECIPE = dict(mechanism="gdn", window=56, sinks=8, adapter="shortconv")
SINKS, WINDOW = 8, 56


def _linear_mixers():
    from linjax.linearize import LINEAR_MIXERS
    return LINEAR_MIXERS


def _kernel_settings(mech: str) -> dict:
    # Hedgehog as LoLCATs runs it: the numerator unnormalised, for the window's softmax terms to join it.
    return dict(normalize=False) if mech == "hedgehog" else {}


# Every linear mechanism of the registry (a new one is compiled and timed without an edit here), and the
# sinks + window softmax that every windowed recipe runs beside it.
KERNELS = (*_linear_mixers(), "sinks_window")


def kernel_inputs(mech: str, B: int, T: int, H: int, D: int, dtype, key=None, sharding=None):
    """The inputs of `mech`'s kernel: q, k, v [B, T, H, ·] in `dtype` after the mechanism's feature map, then
    its gates in fp32, as the mixer registry makes them (`LinearMixer.example_inputs`; sinks + window: q,
    k, v). ShapeDtypeStructs (placed by `sharding`, if given) when key is None, random arrays otherwise."""
    if mech == "sinks_window":
        make = lambda key: tuple(jax.random.normal(k, (B, T, H, D)).astype(dtype)  # noqa: E731
                                 for k in jax.random.split(key, 3))
    else:
        make = lambda key: _linear_mixers()[mech].example_inputs(key, B, T, H, H, D, dtype)  # noqa: E731
    if key is None:
        shapes = jax.eval_shape(make, jax.random.key(0))
        return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in shapes]
    return list(make(key))


def kernel_program(mech: str, form: str, backward: bool):
    """(function of the kernel inputs): `mech`'s kernel in `form` ("pallas" or "chunked"), its first
    output; with `backward`, the gradient of that output's sum with respect to every input."""
    if mech == "sinks_window":
        from linjax.kernels import swa
        call = lambda *a: getattr(swa, form)(*a, sinks=SINKS, window=WINDOW).normalized()  # noqa: E731
    else:
        module, settings = _linear_mixers()[mech].kernel_module, _kernel_settings(mech)
        call = lambda *a: getattr(module, form)(*a, **settings)  # noqa: E731
    forward = lambda *a: jax.tree.leaves(call(*a))[0]  # noqa: E731
    if not backward:
        return forward
    return lambda *a: jax.grad(lambda *b: jnp.sum(forward(*b).astype(jnp.float32)), argnums=tuple(range(len(a))))(*a)


def model_config(name: str, layers: int | None = None):
    from linjax.config import ModelConfig
    shapes = dict(MODELS[name])
    if layers:
        shapes["num_hidden_layers"] = layers
    return ModelConfig(**shapes)


def _random_fill(abstract, seed: int = 0):
    """Random N(0, 0.02²) weights (norms at one) for an abstract state, one small program per leaf."""
    leaves, treedef = jax.tree.flatten(abstract)
    normal = jax.jit(lambda key, shape, dtype: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                     static_argnums=(1, 2))
    key = jax.random.key(seed)
    return jax.tree.unflatten(treedef, [jnp.ones(a.shape, a.dtype) if a.ndim == 1 else
                                        normal(jax.random.fold_in(key, i), a.shape, a.dtype)
                                        for i, a in enumerate(leaves)])


def train_step_program(model: str, batch: int, T: int, what: str, mesh, *, abstract: bool, dtype=None,
                       kernel: str = "auto", layers: int | None = None, settings=None):
    """The training step of `what` ("recipe": the final recipe as `linjax train` builds it; "floor": the
    frozen model's loss and its gradient to the input embeddings, what PyTorch's floor measures) for
    `model` at batch × T tokens on `mesh` (axes "data", "fsdp"). `dtype`, the step's memory settings
    (`settings`, a TrainSection) and `kernel` default to their "auto" values for the platform being
    built for. Returns (a callable / jitted function, its arguments)."""
    from flax import nnx

    import linjax
    from linjax.experiment import ModelSection, TrainSection
    from linjax.model import CausalLM
    from linjax.scan import layer_runs, stack_layers, unstack_layers
    from linjax.train import sharding
    from linjax.train.loop import (
        GPU_COMPILE_OPTIONS,
        abstract_train_state,
        make_optimizer,
        make_train_step,
        place_train_state,
    )
    from linjax.train.objectives import embedding_floor_loss

    settings = settings or TrainSection(steps=100, seq_len=T, batch_size=batch, warmup_steps=10)
    dtype = jnp.dtype(dtype or ModelSection().dtype)
    config = model_config(model, layers)
    build = lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))  # noqa: E731
    tokens_sharding = sharding.batch_sharding(mesh)
    if abstract:
        tokens = jax.ShapeDtypeStruct((batch, T), jnp.int32, sharding=tokens_sharding)
    else:
        tokens = jax.device_put(np.random.default_rng(0).integers(0, config.vocab_size, (batch, T), dtype=np.int32),
                                tokens_sharding)
    remat, loss_chunk = settings.remat_policy(), settings.loss_chunk_size()
    if what == "floor":
        base = nnx.eval_shape(build) if abstract else None
        if not abstract:
            graphdef0, shapes = nnx.split(nnx.eval_shape(build))
            base = nnx.merge(graphdef0, _random_fill(shapes))
        runs = layer_runs(base.layers)
        graphdef, params = nnx.split(base)
        if abstract:
            params = jax.eval_shape(lambda p: stack_layers(p, runs), params)
            params = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), params,
                                  sharding.frozen_shardings(params, mesh))
        else:
            params = sharding.shard_frozen(stack_layers(params, runs), mesh)

        def floor(params, tokens):
            model = nnx.merge(graphdef, unstack_layers(params))
            model.remat = remat
            embeddings = model.embed_tokens(tokens)
            return jax.grad(lambda e: embedding_floor_loss(model, e, tokens, loss_chunk))(embeddings)

        return jax.jit(floor, compiler_options=GPU_COMPILE_OPTIONS), (params, tokens)
    recipe = linjax.LinearizeConfig(**FINAL_RECIPE, kernel=kernel)
    optimizer, _ = make_optimizer(settings, recipe.adapter)
    if abstract:
        model_ = nnx.eval_shape(lambda: linjax.linearize(build(), recipe, seed=1))
        graphdef, trainable, opt_state, frozen = abstract_train_state(model_, optimizer, mesh)
    else:
        graphdef0, shapes = nnx.split(nnx.eval_shape(build))
        model_ = linjax.linearize(nnx.merge(graphdef0, _random_fill(shapes)), recipe, seed=1)
        graphdef, trainable, opt_state, frozen, _ = place_train_state(model_, optimizer, mesh)
    step = make_train_step(graphdef, optimizer, "ce", mesh, remat=remat, loss_chunk=loss_chunk)
    return step, (trainable, opt_state, frozen, tokens)
