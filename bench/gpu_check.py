"""linjax on one GPU, checked by one command: kernel correctness, kernel speed, training steps, memory.

    python bench/gpu_check.py --out results/bench/gpu-check        # one H100: at most 8 minutes
    python bench/gpu_check.py --smoke --out /tmp/gpu-check         # every part at tiny shapes, any machine

Each part runs in its own process under its own time limit (and all of them under --budget
seconds), in this order, so a part that hangs or runs out of memory costs only its own rows:

    tests     pytest tests/kernels/test_gpu.py (every Pallas kernel, forward and input gradients,
              against `reference` in fp32 and bf16), one row per test and its total wall time
    train     training steps with random weights (the torch part runs after the first two),
              each shape in its own process (so `peak_bytes_in_use` is that step's): SmolLM2-135M's
              shapes at batch 1 and 4 × 4,096 and batch 1 × 16,384, Llama-3.1-8B's at batch 1 × 4,096
              (32 layers, else the largest depth that fits, halving); the floor (the frozen model's
              loss and its gradient to the input embeddings) and the final recipe (GDN + window 56 +
              sinks 8 + short conv),
              as `linjax train` runs them with this machine's "auto" settings (bf16 frozen weights,
              remat per layer, the loss in pieces, Pallas kernels); median step, first step
    torch     PyTorch's floor (transformers, SDPA) in fp32 and bf16 at the same shapes
    kernels   B 4, H 16, D 128, bf16, T 1,024 / 4,096 / 16,384 (one process each): GDN, GLA, kGLA
              and sinks + window through the public kernel API by name ("pallas", "chunked"), GDN's
              Pallas form with its in-chunk work as batched XLA ("pallas, XLA in-chunk"), and
              cuDNN's causal softmax; forward and forward + backward
    fla       FLA's chunk_kda and chunk_gla (Triton, through PyTorch), when `fla` imports

Times are medians of synchronised calls after the first, whose seconds (compilation,
autotuning) are a column of their own. Rows go to DIR/rows.jsonl as each is measured;
DIR/gpu_check.json and DIR/gpu_check.md are rewritten after every part. The JAX compilation
cache and Triton's cache live in --cache (default ~/.cache/linjax-gpu-check), so a second run
skips most compilation. docs/gpu.md has the command for the lent GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

PROCESS_START = time.perf_counter()
# Run as a script, bench/ is sys.path[0], and bench/kernels.py would shadow the PyPI `kernels`
# package that transformers probes for at import.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PAPER_STEPS = 2500  # the paper's run: 2,500 steps × 4,096 tokens
FULL = dict(budget=540, kernel_lengths=(4096, 16384), kernel_shape=dict(B=4, H=16, D=128), dtype="bfloat16",
            kernel_repeats=10, train_repeats=5, tests_limit=110, tests_workers=8, train_limit=90, big_limit=100,
            torch_limit=75, kernel_limit=70, fla_limit=90, fla_warmup_extra=20)
SMOKE = dict(budget=900, kernel_lengths=(40,), kernel_shape=dict(B=1, H=2, D=16), dtype="float32",
             kernel_repeats=2, train_repeats=2, tests_limit=300, tests_workers=0, train_limit=300, big_limit=300,
             torch_limit=300, kernel_limit=300, fla_limit=120, fla_warmup_extra=0)
# Beyond this length only the Pallas kernels and cuDNN are timed (the XLA forms were timed at the shorter one).
LONG_KERNEL_T = 4096
# (model, batch, tokens, what) in the order they run: what the acceptance reads first.
TRAIN_RUNS = [("smollm2-135m", 4, 4096, "recipe"), ("smollm2-135m", 1, 4096, "floor"),
              ("smollm2-135m", 1, 4096, "recipe"), ("smollm2-135m", 1, 16384, "recipe"),
              ("llama-3.1-8b", 1, 4096, "recipe"), ("llama-3.1-8b", 1, 4096, "floor"),
              ("smollm2-135m", 4, 4096, "floor"), ("smollm2-135m", 1, 16384, "floor")]
SMOKE_TRAIN_RUNS = [("smollm2-135m", 1, 64, "recipe"), ("llama-3.1-8b", 1, 64, "floor")]
TORCH_RUNS = [("smollm2-135m", 1, 4096, "float32"), ("smollm2-135m", 1, 4096, "bfloat16"),
              ("smollm2-135m", 4, 4096, "bfloat16"), ("llama-3.1-8b", 1, 4096, "bfloat16")]
SMOKE_TORCH_RUNS = [("smollm2-135m", 1, 64, "float32"), ("smollm2-135m", 1, 64, "bfloat16")]


def model_shapes(name: str, smoke: bool) -> dict:
    """HF-style config fields of the model's shapes (tiny ones under --smoke)."""
    if smoke:
        return dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                    tie_word_embeddings=name.startswith("smollm2"))
    if name == "smollm2-135m":
        return dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    return dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192, max_position_embeddings=131072)


# ------------------------------------------------------------------------------------------- output


def append_row(out: str, row: dict):
    """One JSON line appended to DIR/rows.jsonl and flushed: a part killed later keeps it."""
    with open(os.path.join(out, "rows.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print(json.dumps(row), flush=True)


def read_rows(out: str) -> list[dict]:
    path = os.path.join(out, "rows.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def error_text(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {(lines[0] if lines else '')[:300]}"


def out_of_memory(row: dict) -> bool:
    text = row.get("error", "")
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory"))


def timed(call, sync, repeats: int):
    """(first call's seconds, median of `repeats` synchronised calls after it)."""
    start = time.perf_counter()
    sync(call())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times) if times else None


# ------------------------------------------------------------------------------------------- parts


def part_tests(args, sizes):
    """pytest on the GPU tests, with pytest-xdist's 4 workers where it is installed and a GPU is here.
    A row per test as pytest reports it (so a run cut short keeps its results), then the total."""
    import importlib.util
    import re

    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/kernels/test_gpu.py"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(sizes["tests_workers"])]
    # The GPU settings of tests/conftest.py, whatever its own detection finds on this machine.
    env = dict(os.environ, LINJAX_INSTANT_FAILURES="1")
    if not args.smoke:
        env["LINJAX_TESTS_GPU"] = "1"
    # "[gw1] [ 50%] PASSED tests/...::name" with workers, "tests/...::name PASSED [ 50%]" without.
    outcome_re = re.compile(r"(?:(PASSED|FAILED|ERROR|SKIPPED)\s+(tests/\S+::\S+))"
                            r"|(?:(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED))")
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    counts, last, seen, explained = {}, "", set(), set()
    for line in process.stdout:
        line = line.rstrip()
        last = line or last
        if line.startswith("INSTANT-FAILURE ") and " :: " in line:  # tests/conftest.py, as each test fails
            test, message = line[len("INSTANT-FAILURE "):].split(" :: ", 1)
            append_row(args.out, dict(part="tests", test=test.split("::")[-1], outcome="message", message=message))
            explained.add(test.split("::")[-1])
            continue
        if line.startswith(("FAILED ", "ERROR ")) and " - " in line:  # the -ra summary: the failure's message
            if line.split()[1].split("::")[-1] in explained:
                continue
            append_row(args.out, dict(part="tests", test=line.split()[1].split("::")[-1], outcome="message",
                                      message=line.split(" - ", 1)[1][:300]))
            continue
        match = outcome_re.search(line)
        if not match or line.startswith(("FAILED ", "ERROR ")):
            continue
        outcome, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        if test in seen:
            continue
        seen.add(test)
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
        if outcome != "SKIPPED" or args.smoke:
            append_row(args.out, dict(part="tests", test=test.split("::")[-1], outcome=outcome.lower(),
                                      seconds_since_start=time.perf_counter() - start))
    status = process.wait()
    append_row(args.out, dict(part="tests", test="(all)", outcome="passed" if status == 0 else f"exit {status}",
                              seconds=time.perf_counter() - start, counts=counts, summary=last[:300]))


def part_kernels(args, sizes, T: int):
    import jax
    import jax.numpy as jnp

    from linjax.kernels import gdn, gla, kgla, linear_attn, swa

    B, H, D = (sizes["kernel_shape"][k] for k in "BHD")
    dtype = jnp.dtype(sizes["dtype"])
    keys = jax.random.split(jax.random.key(T), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731  (the mixers' L2 norm)
    q, k = (unit(jax.random.normal(key, (B, T, H, D))).astype(dtype) for key in keys[:2])
    v = jax.random.normal(keys[2], (B, T, H, D)).astype(dtype)
    log_alpha = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H, D)) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
    mechanisms = {"gdn": (gdn, (q, k, v, log_alpha, beta), {}), "gla": (gla, (q, k, v, log_alpha), {}),
                  "kgla": (kgla, (q, k, v, log_alpha, beta), {}), "sinks+window": (swa, (q, k, v),
                                                                                  dict(sinks=8, window=56)),
                  # LoLCATs' form (Hedgehog): positive features, fp32, values with a column of ones (D + 1 wide)
                  "hedgehog": (linear_attn, (jax.nn.softmax(q.astype(jnp.float32)), jax.nn.softmax(k.astype(
                      jnp.float32)), v), dict(normalize=False))}
    if args.smoke:  # the plumbing only: one recurrent kernel and the window kernel (each compile costs a CPU ~20 s)
        mechanisms = {name: mechanisms[name] for name in ("gdn", "sinks+window")}
    methods = [(mech, kernel) for mech in mechanisms for kernel in ("pallas", "chunked")
               if kernel == "pallas" or (T <= LONG_KERNEL_T and mech != "kgla")]
    methods.insert(2 if T <= LONG_KERNEL_T else 1, ("softmax", "cudnn" if _has_cuda() else "xla"))
    if T <= LONG_KERNEL_T:  # the XLA form GPUs ran before FLA's decomposition: the baseline
        methods.insert(2, ("gdn", "chunked, CPU form"))
    if not args.smoke:  # the Pallas GDN with its in-chunk work as batched XLA, as before its K1 kernel
        methods.insert(1, ("gdn", "pallas, XLA in-chunk"))
    for mech, kernel in methods:
        if mech == "softmax":
            fn = lambda q, k, v, impl=kernel: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, implementation=impl)
            arrays = (q, k, v)
        elif kernel == "chunked, CPU form":
            fn, arrays = _gdn_cpu_form, mechanisms["gdn"][1]
        elif kernel == "pallas, XLA in-chunk":
            fn, arrays = functools.partial(gdn.pallas, intra="xla"), mechanisms["gdn"][1]
        else:
            module, arrays, settings = mechanisms[mech]
            fn = lambda *a, f=getattr(module, kernel), s=settings: f(*a, **s)  # noqa: E731
        row = dict(part="kernels", mech=mech, kernel=kernel, T=T, B=B, H=H, D=D, dtype=str(dtype))
        try:
            forward = jax.jit(fn)
            backward = jax.jit(jax.grad(lambda *a, f=fn: jnp.sum(jax.tree.leaves(f(*a))[0].astype(jnp.float32)),
                                        argnums=tuple(range(len(arrays)))))
            row["forward_first_s"], row["forward_s"] = timed(lambda: forward(*arrays), jax.block_until_ready,
                                                             sizes["kernel_repeats"])
            row["forward_backward_first_s"], row["forward_backward_s"] = timed(
                lambda: backward(*arrays), jax.block_until_ready, sizes["kernel_repeats"])
        except Exception as error:  # one method's failure is a result, not the end of the part
            row["error"] = error_text(error)
        row["repeats"] = sizes["kernel_repeats"]
        append_row(args.out, row)


def _gdn_cpu_form(q, k, v, log_alpha, beta):
    """`gdn.chunked` as a CPU lowering runs it (each chunk's whole work inside the scan over chunks),
    on whatever device this is."""
    from linjax.kernels import gdn
    q32, k32, v32, la, b, S0, scale = gdn._prepare(q, k, v, log_alpha, beta, None, None)
    o, S = gdn._chunk_scan(q32, k32, v32, la, b, S0, chunk=gdn.CHUNK)
    return (o * scale).astype(v.dtype), S


def part_fla(args, sizes, warmup: bool = False):
    try:
        import torch
        from fla.ops.gla import chunk_gla
        from fla.ops.kda import chunk_kda
    except ImportError as error:
        append_row(args.out, dict(part="fla", error=f"not run: {error_text(error)}"))
        return
    if not torch.cuda.is_available():
        append_row(args.out, dict(part="fla", error="not run: FLA's Triton kernels need CUDA"))
        return
    B, H, D = (sizes["kernel_shape"][k] for k in "BHD")
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    for T in sizes["kernel_lengths"][:1] if warmup else sizes["kernel_lengths"]:
        gen = torch.Generator(device="cuda").manual_seed(T)
        randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
        q, k = (torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).bfloat16() for _ in range(2))
        v = randn(B, T, H, D).bfloat16()
        g = torch.nn.functional.logsigmoid(randn(B, T, H, D) + 3.0)
        beta = torch.sigmoid(randn(B, T, H))
        runs = (("chunk_kda", chunk_kda, (q, k, v, g, beta)), ("chunk_gla", chunk_gla, (q, k, v, g)))
        for name, kernel, inputs in runs:
            row = dict(part="fla-warmup" if warmup else "fla", mech=name, T=T, B=B, H=H, D=D, dtype="bfloat16")
            repeats = 0 if warmup else sizes["kernel_repeats"]
            try:
                row["forward_first_s"], row["forward_s"] = timed(lambda: kernel(*inputs), sync, repeats)
                leaves = [x.detach().requires_grad_() for x in inputs]
                row["forward_backward_first_s"], row["forward_backward_s"] = timed(
                    lambda: kernel(*leaves)[0].float().sum().backward(), sync, repeats)
            except Exception as error:
                row["error"] = error_text(error)
            row["repeats"] = repeats
            append_row(args.out, row)


def random_model(shapes: dict, dtype, layers: int):
    """A CausalLM with random weights (N(0, 0.02²), norms at one), made on the device leaf by leaf:
    one small program per distinct shape, not one program with every leaf as an output."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from linjax.config import ModelConfig
    from linjax.model import CausalLM

    config = ModelConfig(**{**shapes, "num_hidden_layers": layers})
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree.flatten(abstract)
    key = jax.random.key(0)
    normal = jax.jit(lambda key, shape, dtype: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                     static_argnums=(1, 2))
    filled = [jnp.ones(a.shape, a.dtype) if a.ndim == 1 else normal(jax.random.fold_in(key, i), a.shape, a.dtype)
              for i, a in enumerate(leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, filled))


def part_train(args, sizes, model_name: str, batch: int, tokens: int, what: str, layers: int | None):
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import linjax
    from linjax.scan import layer_runs, stack_layers, unstack_layers
    from linjax.train import sharding
    from linjax.experiment import ModelSection, TrainSection
    from linjax.train.loop import make_optimizer, make_train_step, place_train_state
    from linjax.train.objectives import embedding_floor_loss

    started = time.perf_counter()

    def phase(name):  # a row per stage, so a part stopped at its limit shows where it was
        append_row(args.out, dict(part="train-phase", model=model_name, what=what, batch=batch, T=tokens,
                                  layers=layers, phase=name, seconds=time.perf_counter() - started))

    shapes = model_shapes(model_name, args.smoke)
    layers = layers or shapes["num_hidden_layers"]
    dtype = ModelSection().dtype  # "auto": bf16 frozen weights on a GPU
    settings = TrainSection(steps=100, seq_len=tokens, batch_size=batch, warmup_steps=10)
    recipe = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv")  # kernel "auto"
    row = dict(part="train", model=model_name, what=what, batch=batch, T=tokens, layers=layers,
               total_layers=shapes["num_hidden_layers"], dtype=dtype, remat=settings.remat_policy(),
               loss_chunk=settings.loss_chunk_size(), kernel=recipe.kernel if what == "recipe" else None,
               resolved_kernel=("pallas" if recipe.uses_pallas() else "chunked") if what == "recipe" else None)
    phase(f"started ({started - PROCESS_START:.1f} s of imports)")
    try:
        base = random_model(shapes, jnp.dtype(dtype), layers)
        phase("random weights made")
        batch_tokens = jnp.asarray(np.random.default_rng(0).integers(0, shapes["vocab_size"], (batch, tokens)),
                                   jnp.int32)
        if what == "floor":
            graphdef, params = nnx.split(base)
            params = stack_layers(params, layer_runs(base.layers))
            del base

            def floor(params, tokens):
                model = nnx.merge(graphdef, unstack_layers(params))
                model.remat = settings.remat_policy()
                embeddings = model.embed_tokens(tokens)
                return jax.grad(lambda e: embedding_floor_loss(model, e, tokens, settings.loss_chunk_size()))(
                    embeddings)

            start = time.perf_counter()
            lowered = jax.jit(floor).lower(params, batch_tokens)
            phase("lowered")
            compiled = lowered.compile()
            call = lambda: compiled(params, batch_tokens)  # noqa: E731
        else:
            mesh = sharding.make_mesh()
            model = linjax.linearize(base, recipe, seed=1)
            phase("linearized")
            optimizer, _ = make_optimizer(settings, recipe.adapter)
            graphdef, trainable, opt_state, frozen, _ = place_train_state(model, optimizer, mesh)
            del model, base
            phase("train state placed")
            train_step = make_train_step(graphdef, optimizer, "ce", mesh, remat=settings.remat_policy(),
                                         loss_chunk=settings.loss_chunk_size())
            start = time.perf_counter()
            lowered = train_step.lower(trainable, opt_state, frozen, batch_tokens)
            phase("lowered")
            compiled = lowered.compile()
            state = [trainable, opt_state]

            def call():
                new_trainable, new_opt_state, metrics = compiled(*state, frozen, batch_tokens)
                state[:] = [new_trainable, new_opt_state]
                return metrics

        row["compile_s"] = time.perf_counter() - start
        phase("compiled")
        gc.collect()
        memory = compiled.memory_analysis()
        if memory is not None:
            row["compiled_temp_bytes"] = int(memory.temp_size_in_bytes)
        first_call, row["median_step_s"] = timed(call, jax.block_until_ready, sizes["train_repeats"])
        row["first_step_s"] = row["compile_s"] + first_call  # compilation included, as `linjax train` pays it
        row["tokens_per_s"] = batch * tokens / row["median_step_s"]
        row["repeats"] = sizes["train_repeats"]
        if model_name == "llama-3.1-8b":
            # Per layer and scaled to the full depth: the embedding and the LM head are counted in every
            # layer's share, so a projection from a reduced depth errs long.
            row["step_s_per_layer"] = row["median_step_s"] / layers
            full_step = row["median_step_s"] * row["total_layers"] / layers
            row["projected_paper_run_h"] = PAPER_STEPS * full_step / 3600
    except Exception as error:
        row["error"] = error_text(error)
    stats = _memory_stats()
    if stats:
        row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    append_row(args.out, row)


def part_torch(args, sizes):
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        append_row(args.out, dict(part="torch", error=f"not run: {error_text(error)}"))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    runs = SMOKE_TORCH_RUNS if args.smoke else TORCH_RUNS
    for model_name, batch, tokens, dtype_name in runs:
        shapes = model_shapes(model_name, args.smoke)
        row = dict(part="torch", model=model_name, what="floor (SDPA)", batch=batch, T=tokens, dtype=dtype_name,
                   device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
        model = None
        try:
            dtype = getattr(torch, dtype_name)
            config = LlamaConfig(vocab_size=shapes["vocab_size"], hidden_size=shapes["hidden_size"],
                                 intermediate_size=shapes["intermediate_size"],
                                 num_hidden_layers=shapes["num_hidden_layers"],
                                 num_attention_heads=shapes["num_attention_heads"],
                                 num_key_value_heads=shapes["num_key_value_heads"], head_dim=shapes["head_dim"],
                                 rms_norm_eps=shapes["rms_norm_eps"], tie_word_embeddings=shapes.get("tie_word_embeddings", False),
                                 max_position_embeddings=max(tokens, 8192), attn_implementation="sdpa")
            torch.manual_seed(0)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # made in its dtype: an 8B model in fp32 first would take 32 GB
            try:
                with torch.device(device):
                    model = LlamaForCausalLM(config).eval()
            finally:
                torch.set_default_dtype(default_dtype)
            for p in model.parameters():
                p.requires_grad_(False)
            ids = torch.randint(0, shapes["vocab_size"], (batch, tokens), device=device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()

            def floor():
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                model(inputs_embeds=embeds, labels=ids).loss.backward()
                return embeds.grad

            row["first_step_s"], row["median_step_s"] = timed(floor, sync, sizes["train_repeats"])
            row["tokens_per_s"] = batch * tokens / row["median_step_s"]
            row["repeats"] = sizes["train_repeats"]
            if device == "cuda":
                row["peak_bytes_in_use"] = torch.cuda.max_memory_allocated()
        except Exception as error:
            row["error"] = error_text(error)
        append_row(args.out, row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def _has_cuda() -> bool:
    from linjax.platform import has_cuda
    return has_cuda()


def _memory_stats() -> dict:
    import jax
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU devices have none
        return {}


# ------------------------------------------------------------------------------------------- driver


def schedule(sizes, smoke):
    """[(label, part argv, time limit in s)] in running order: what the acceptance reads first (the
    tests, the final recipe at batch 4, the floor beside PyTorch's, the kernels at 4,096, the recipe at
    1 × 4,096 and 16,384, the kernels at 16,384, FLA, the 8B step). The 8B depth retries are added as needed."""
    train = []
    for model, batch, tokens, what in (SMOKE_TRAIN_RUNS if smoke else TRAIN_RUNS):
        limit = sizes["big_limit"] if model.startswith("llama") else sizes["train_limit"]
        train.append((f"train {model} {what} {batch}x{tokens}", ["train", model, str(batch), str(tokens), what], limit))
    kernels = [(f"kernels T {T}", ["kernels", str(T)], sizes["kernel_limit"]) for T in sizes["kernel_lengths"]]
    return [("tests", ["tests"], sizes["tests_limit"]), *train[:2], ("torch", ["torch"], sizes["torch_limit"]),
            *kernels[:1], *train[2:4], *kernels[1:], ("fla", ["fla"], sizes["fla_limit"]), *train[4:]]


def start_part(args, label, part_argv, env, limit=None) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--part", *part_argv, "--out", args.out]
    if limit is not None and limit > 10:  # the part prints every thread's stack just before its limit
        command += ["--stacks-after", f"{limit - 4:.0f}"]
    if args.smoke:
        command.append("--smoke")
    print(f"== {label}", flush=True)
    # Its own process group: at the limit, the part and whatever it started (pytest and its workers)
    # end together, so nothing of it keeps the GPU busy under the next part.
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)


def wait_part(process, limit) -> int | None:
    """The part's exit status, or None if it ran out of time (then it and its children are killed)."""
    try:
        return process.wait(timeout=max(limit, 0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def run_part(args, label, part_argv, limit, env) -> tuple[int | None, float]:
    """Runs one part in its own process; (exit status or None if it ran out of time, seconds)."""
    start = time.perf_counter()
    status = wait_part(start_part(args, f"{label} (limit {limit:.0f} s)", part_argv, env, limit), limit)
    return status, time.perf_counter() - start


def driver(args):
    sizes = SMOKE if args.smoke else FULL
    budget = args.budget or sizes["budget"]
    if os.path.exists(os.path.join(args.out, "rows.jsonl")):
        sys.stderr.write(f"gpu_check: {args.out} already holds a run (rows.jsonl); choose another --out\n")
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    cache = os.path.abspath(os.path.expanduser(args.cache))
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    wanted = set(args.parts.split(",")) if args.parts else None
    started = time.perf_counter()
    runs = []
    plan = [p for p in schedule(sizes, args.smoke) if wanted is None or p[1][0] in wanted]
    # FLA's first calls are mostly Triton autotuning (minutes): it compiles beside the GPU tests, which
    # are not timed but as a whole, into the shared Triton cache that the timed FLA part reads later.
    warmup = None
    if any(p[1][0] == "fla" for p in plan) and any(p[1][0] == "tests" for p in plan):
        warmup = (start_part(args, "fla warm-up, beside the tests", ["fla", "warmup"], env), time.perf_counter())
    while plan:
        label, part_argv, limit = plan.pop(0)
        left = budget - (time.perf_counter() - started)
        if left < 10:
            runs.append(dict(part=label, status="not run: the budget was spent"))
            continue
        seen = len(read_rows(args.out))
        status, seconds = run_part(args, label, part_argv, min(limit, left), env)
        runs.append(dict(part=label, status="timed out" if status is None else f"exit {status}", seconds=seconds))
        if part_argv[0] == "tests" and warmup is not None:
            status = wait_part(warmup[0], sizes["fla_warmup_extra"])
            runs.append(dict(part="fla warm-up, beside the tests", seconds=time.perf_counter() - warmup[1],
                             status="stopped after the tests" if status is None else f"exit {status}"))
            warmup = None
        new_rows = read_rows(args.out)[seen:]
        if part_argv[0] == "train" and part_argv[1].startswith("llama") and any(map(out_of_memory, new_rows)):
            layers = min(r["layers"] for r in new_rows) // 2
            if layers >= 2:  # the largest depth that fits, halving
                plan.insert(0, (f"{label} ({layers} layers)", part_argv[:5] + [str(layers)], limit))
        write_report(args, runs, time.perf_counter() - started)
    print(markdown(report(args, runs, time.perf_counter() - started)))


def report(args, runs, seconds) -> dict:
    import jax
    return dict(device=_device_name(), jax=jax.__version__, python=platform.python_version(), smoke=args.smoke,
                seconds=seconds, parts=runs, rows=read_rows(args.out))


def _device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return platform.processor() or platform.machine()


def write_report(args, runs, seconds):
    from linjax.files import write_json, write_text
    data = report(args, runs, seconds)
    write_json(os.path.join(args.out, "gpu_check.json"), data)
    write_text(os.path.join(args.out, "gpu_check.md"), markdown(data))


def markdown(data) -> str:
    rows = data["rows"]
    ms = lambda r, key: f"{1e3 * r[key]:.2f}" if r.get(key) is not None else "–"  # noqa: E731
    s = lambda r, key: f"{r[key]:.3f}" if r.get(key) is not None else "–"  # noqa: E731
    gb = lambda r, key: f"{r[key] / 2**30:.1f}" if r.get(key) is not None else "–"  # noqa: E731
    err = lambda r: f" **{r['error']}**" if "error" in r else ""  # noqa: E731
    lines = [f"# linjax GPU check on {data['device']}", "",
             f"JAX {data['jax']}, Python {data['python']}, {data['seconds']:.0f} s in all"
             f"{' (smoke: tiny shapes)' if data['smoke'] else ''}. `python bench/gpu_check.py` (docs/gpu.md).", "",
             "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {p['part']} | {p['status']} | {p.get('seconds', 0):.0f} |" for p in data["parts"]]
    tests = [r for r in rows if r["part"] == "tests"]
    if tests:
        lines += ["", "## GPU tests (tests/kernels/test_gpu.py)", "",
                  "| test | outcome | s (the total's; a test's since the start) |", "|---|---|---|"]
        lines += [f"| {r['test']} | {r['outcome']}{' ' + r['message'] if r.get('message') else ''}"
                  f"{' ' + str(r['counts']) if r.get('counts') else ''} | "
                  f"{r.get('seconds', r.get('seconds_since_start', 0)):.1f} |" for r in tests]
    train = [r for r in rows if r["part"] in ("train", "torch")]
    if train:
        lines += ["", "## Training steps (random weights)", "",
                  "| framework | model | what | batch × T | layers | dtype | median step s | first step s | "
                  "tokens/s | peak GB | 2,500-step run h |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            what = r.get("what", "")
            if r["part"] == "train":
                what = {"floor": "floor", "recipe": f"final recipe ({r.get('resolved_kernel')})"}.get(what, what)
            lines.append(f"| {'linjax' if r['part'] == 'train' else 'PyTorch'} | {r.get('model', '')} | {what}{err(r)} "
                         f"| {r.get('batch', '')} × {r.get('T', '')} | {r.get('layers', '')} | {r.get('dtype', '')} "
                         f"| {s(r, 'median_step_s')} | {s(r, 'first_step_s')} "
                         f"| {r['tokens_per_s']:,.0f} |" if "tokens_per_s" in r else
                         f"| {'linjax' if r['part'] == 'train' else 'PyTorch'} | {r.get('model', '')} | {what}{err(r)} "
                         f"| {r.get('batch', '')} × {r.get('T', '')} | {r.get('layers', '')} | {r.get('dtype', '')} "
                         f"| – | – | – |")
            lines[-1] += f" {gb(r, 'peak_bytes_in_use')} | {s(r, 'projected_paper_run_h')} |"
    phases = [r for r in rows if r["part"] == "train-phase"]
    if phases:
        lines += ["", "## Training parts, stage by stage (seconds since the part started)", "",
                  "| model | what | batch × T | stage | s |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['what']} | {r['batch']} × {r['T']} | {r['phase']} | {r['seconds']:.1f} |"
                  for r in phases]
    kernels = [r for r in rows if r["part"] in ("kernels", "fla", "fla-warmup")]
    if kernels:
        lines += ["", "## Kernels", "", "| mechanism | method | T | forward ms | forward + backward ms | "
                  "first forward s | first forward + backward s |", "|---|---|---|---|---|---|---|"]
        for r in kernels:
            method = {"kernels": r.get("kernel"), "fla": "FLA", "fla-warmup": "FLA (first calls, beside the tests)"}[
                r["part"]]
            lines.append(f"| {r.get('mech', '')} | {method}{err(r)} | {r.get('T', '')} | {ms(r, 'forward_s')} "
                         f"| {ms(r, 'forward_backward_s')} | {s(r, 'forward_first_s')} "
                         f"| {s(r, 'forward_backward_first_s')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rows.jsonl, gpu_check.json and gpu_check.md")
    p.add_argument("--smoke", action="store_true", help="every part at tiny shapes; runs on a CPU")
    p.add_argument("--budget", type=float, default=None, help="seconds for all parts together (default 480)")
    p.add_argument("--parts", default=None, help="comma-separated subset of: tests,train,torch,kernels,fla")
    p.add_argument("--cache", default="~/.cache/linjax-gpu-check", help="JAX and Triton compilation caches")
    p.add_argument("--part", nargs="+", default=None, help=argparse.SUPPRESS)  # one part, in a child process
    p.add_argument("--stacks-after", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.parts and not set(args.parts.split(",")) <= {"tests", "train", "torch", "kernels", "fla"}:
        sys.stderr.write(f"gpu_check: --parts takes tests, train, torch, kernels, fla; got {args.parts!r}\n")
        sys.exit(2)
    if args.part is None:
        if not args.smoke and not _cuda_visible():
            sys.stderr.write("gpu_check: no CUDA GPU here (nvidia-smi finds none); --smoke runs the parts at tiny "
                             "shapes on any machine\n")
            sys.exit(2)
        return driver(args)
    sizes = SMOKE if args.smoke else FULL
    if args.stacks_after:  # a part that is about to be stopped shows where it was (in the log)
        import faulthandler
        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    name, *rest = args.part
    if name == "tests":
        part_tests(args, sizes)
    elif name == "kernels":
        part_kernels(args, sizes, int(rest[0]))
    elif name == "fla":
        part_fla(args, sizes, warmup=rest[:1] == ["warmup"])
    elif name == "torch":
        part_torch(args, sizes)
    elif name == "train":
        model, batch, tokens, what = rest[:4]
        part_train(args, sizes, model, int(batch), int(tokens), what, int(rest[4]) if len(rest) > 4 else None)


def _cuda_visible() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if __name__ == "__main__":
    main()
