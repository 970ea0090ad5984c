"""The GPU memory and precision policy: the LM-head loss in pieces, remat per layer, and the "auto"
settings (which resolve to today's CPU behaviour on a machine without a CUDA device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.experiment import ModelSection, TrainSection
from linjax.model import CausalLM
from linjax.platform import has_cuda
from linjax.train.objectives import lm_loss, next_token_loss
from tests.helpers import relative_rms


def tiny_model(layers=3):
    return CausalLM(tiny_config("llama", num_hidden_layers=layers, vocab_size=301), rngs=nnx.Rngs(0))


def test_loss_in_pieces_equals_the_whole_and_keeps_no_full_logits():
    model = tiny_model()
    B, T, V = 2, 150, 301
    hidden = jax.random.normal(jax.random.key(0), (B, T, 64))
    targets = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    loss_and_grad = nnx.jit(lambda model, h, chunk: jax.value_and_grad(lambda h: lm_loss(model, h, targets, chunk))(h),
                            static_argnums=2)
    whole, whole_grad = loss_and_grad(model, hidden, None)
    for chunk in (32, 400):  # 150 = 4 pieces of 32 and one of 22
        value, grad = loss_and_grad(model, hidden, chunk)
        np.testing.assert_allclose(float(value), float(whole), rtol=1e-6)
        assert relative_rms(grad, whole_grad) < 1e-6
    _, pullback = jax.vjp(lambda h: lm_loss(model, h, targets, 32), hidden)
    assert max(leaf.size for leaf in jax.tree.leaves(pullback)) < B * T * V / 2
    _, pullback = jax.vjp(lambda h: lm_loss(model, h, targets), hidden)
    assert max(leaf.size for leaf in jax.tree.leaves(pullback)) >= B * T * V  # what the pieces avoid


@pytest.mark.parametrize("remat", ["full"])
def test_remat_per_layer_gives_the_same_loss_and_gradients(remat):
    """A hybrid (layer 1 kept softmax) has runs of one block: those are recomputed too."""
    base = tiny_model()
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=8, sinks=2, adapter="shortconv",
                                                          keep_full_attention=(1,)), seed=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, 301)
    graphdef, trainable, frozen = nnx.split(model, linjax.layers.Trainable, ...)

    def loss(trainable, remat):
        m = nnx.merge(graphdef, trainable, frozen)
        m.remat = remat
        return next_token_loss(m, tokens, loss_chunk=16)

    loss_and_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    plain, plain_grads = loss_and_grads(trainable, None)
    value, grads = loss_and_grads(trainable, remat)
    np.testing.assert_allclose(float(value), float(plain), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        assert relative_rms(a, b) < 1e-5


@pytest.mark.skipif(has_cuda(), reason="the 'auto' settings pick the GPU forms where JAX has a CUDA device")
def test_auto_settings_keep_the_cpu_behaviour():
    assert ModelSection().dtype == "float32"
    train = TrainSection()
    assert train.remat_policy() is None and train.loss_chunk_size() is None
    assert linjax.LinearizeConfig().kernel == "auto" and not linjax.LinearizeConfig().uses_pallas()
    assert linjax.LinearizeConfig(kernel="pallas").uses_pallas()


def test_a_run_names_the_devices_it_ran_on(monkeypatch):
    from linjax import platform
    Device = type("Device", (), {})

    def devices(platform_name, kind, count):
        made = [Device() for _ in range(count)]
        for d in made:
            d.platform, d.device_kind = platform_name, kind
        return made

    monkeypatch.setattr(jax, "devices", lambda *a: devices("gpu", "NVIDIA H200", 8))
    assert platform.device_description() == "gpu: 8 x NVIDIA H200"
    monkeypatch.setattr(jax, "devices", lambda *a: devices("cpu", "cpu", 1))
    assert platform.device_description() == "cpu"


def test_policy_settings_are_checked():
    assert TrainSection(remat="full").remat_policy() == "full"
    assert TrainSection(remat="layer").remat_policy() == "dots"
    assert TrainSection(remat="none", loss_chunk=0).loss_chunk_size() is None
    assert TrainSection(loss_chunk=512).loss_chunk_size() == 512
    assert ModelSection(dtype="bfloat16").dtype == "bfloat16"
    for bad in (dict(remat="yes"), dict(loss_chunk=-1), dict(loss_chunk="big"), dict(loss_chunk=True)):
        with pytest.raises(ValueError, match="train.(remat|loss_chunk)"):
            TrainSection(**bad)
    with pytest.raises(ValueError, match="model.dtype"):
        ModelSection(dtype="fp8")


def test_bf16_frozen_weights_train_fp32_parameters():
    """Frozen weights in bf16, the new parameters (and so AdamW's moments) in fp32."""
    base = CausalLM(tiny_config("llama"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", adapter="shortconv"), seed=1)
    frozen = jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, nnx.Not(linjax.layers.Trainable))))
    trainable = jax.tree.leaves(nnx.state(model, linjax.layers.Trainable))
    assert {x.dtype for x in frozen} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in trainable} == {jnp.dtype(jnp.float32)}
    tokens = jax.random.randint(jax.random.key(3), (1, 33), 0, 128)
    assert np.isfinite(float(nnx.jit(lambda m, t: next_token_loss(m, t, loss_chunk=8))(model, tokens)))
