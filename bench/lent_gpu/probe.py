"""Time `linjax train`'s step for the claims rows on this GPU: SmolLM2-135M shapes with random weights,
the final recipe, 1 x 512 tokens, fp32, the XLA chunked kernel; at each matmul precision given."""
import os, sys, time
T0 = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import jax, jax.numpy as jnp, numpy as np
import linjax
from gpu_check import random_model, model_shapes
from linjax.experiment import TrainSection
from linjax.train import sharding
from linjax.train.loop import make_optimizer, make_train_step, place_train_state

def say(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)

say("imports", jax.devices())
settings = TrainSection(steps=2000, seq_len=512, batch_size=1, warmup_steps=100)
recipe = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv", kernel="chunked")
base = random_model(model_shapes("smollm2-135m", False), jnp.float32, 30)
say("random weights")
mesh = sharding.make_mesh()
model = linjax.linearize(base, recipe, seed=1)
optimizer, _ = make_optimizer(settings, recipe.adapter)
graphdef, trainable, opt_state, frozen, _ = place_train_state(model, optimizer, mesh)
say("placed; remat", settings.remat_policy(), "loss_chunk", settings.loss_chunk_size())
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (1, 512)), jnp.int32)
for precision in sys.argv[1:]:
    with jax.default_matmul_precision(precision):
        step = make_train_step(graphdef, optimizer, "ce", mesh, remat=settings.remat_policy(),
                               loss_chunk=settings.loss_chunk_size())
        t = time.perf_counter(); compiled = step.lower(trainable, opt_state, frozen, tokens).compile()
        say(precision, f"compiled in {time.perf_counter() - t:.1f} s")
        state = [trainable, opt_state]
        times = []
        for i in range(25):
            t = time.perf_counter()
            new_t, new_o, metrics = compiled(*state, frozen, tokens)
            jax.block_until_ready(metrics)
            state = [new_t, new_o]
            times.append(time.perf_counter() - t)
        say(precision, f"median step {1000 * np.median(times[5:]):.1f} ms, first {1000 * times[0]:.1f} ms, "
            f"loss {float(metrics['loss']) if isinstance(metrics, dict) and 'loss' in metrics else metrics}")
