"""linjax on one GPU, checked by one command that fits one 10-minute device call.

    python bench/gpu_check.py --out results/bench/gpu-check-DATE        # one H100 / H200: at most 420 s
    python bench/gpu_check.py --smoke --out /tmp/gpu-check               # tiny shapes, any machine (CI runs it)

Parts, the most informative first, each in a process of its own under its own limit (full run, seconds);
a part that hangs or runs out of memory costs only its own rows:

    train     75  the final recipe's training step at SmolLM2-135M's shapes, 4 × 4,096 tokens, random weights,
                  as `linjax train` runs it on a GPU (bench/programs.py: bf16 frozen weights, whole-layer remat,
                  the loss in 1,024-position pieces, Pallas kernels): the loss and gradient norm of every step,
                  the first step (compilation included), the median step, the compiled program's memory
    torch     40  PyTorch's floor at the same shape (transformers, SDPA, bf16: the frozen model's loss and its
                  gradient to the input embeddings), the reference the recipe's step is judged against
    train     45  the same step at 1 × 4,096
    kernels   60  every kernel at B 4, H 16, D 128, T 4,096, bf16: each Pallas kernel forward and forward +
                  backward (first call apart from the median), its output compared with the XLA `chunked`
                  form's; `chunked` timed too; cuDNN's causal softmax over the whole sequence, and with a local
                  window of 64 (the nearest cuDNN form of sinks 8 + window 56)
    tests     60  tests/kernels/test_gpu.py, the gradient tests first, each failure printed as it happens
    kernels   45  the same at T 16,384: Pallas and cuDNN only
    train     70  Llama-3.1-8B's final recipe step at 1 × 4,096 (32 layers; fewer, halving, if it does not
                  fit): step time and the projected 2,500-step run
    fla       30  FLA's chunk_gated_delta_rule, chunk_kda and chunk_gla, each with only the first configuration
                  of its autotuning lists (labelled "untuned"; FLA's own tuning outlasts any limit here)

Rows go to DIR/rows.jsonl as each is measured; DIR/gpu_check.json and .md are rewritten after every part,
with the deviceless compile of the same programs (results/bench/compile-gpu-*/, bench/compile_gpu.py)
beside the card's; DIR/gpu_check.log keeps every part's output. JAX's and Triton's compilation caches
live in --cache (default ~/.cache/linjax-gpu-check), so a second run skips most compilation.
docs/gpu.md and bench/lent_gpu/README.md have the command for the lent GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

PROCESS_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# bench/ is not a package, and on sys.path its kernels.py would shadow the PyPI package `kernels`.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PAPER_STEPS = 2500  # the paper's run: 2,500 steps × 4,096 tokens
FULL = dict(budget=420, kernel_shape=dict(B=4, H=16, D=128), dtype="bfloat16", kernel_repeats=10, train_repeats=5,
            long_T=16384, short_T=4096, train=[("smollm2-135m", 4, 4096, 75), ("smollm2-135m", 1, 4096, 45),
                                               ("llama-3.1-8b", 1, 4096, 70)],
            torch=[("smollm2-135m", 4, 4096, "bfloat16")], limits=dict(torch=40, kernels=60, long_kernels=45,
                                                                         tests=60, fla=30), tests_workers=8)
SMOKE = dict(budget=900, kernel_shape=dict(B=1, H=2, D=16), dtype="float32", kernel_repeats=2, train_repeats=2,
             long_T=64, short_T=40, train=[("tiny", 1, 128, 300), ("tiny", 2, 128, 300)],
             torch=[("tiny", 1, 64, "float32")], limits=dict(torch=300, kernels=300, long_kernels=300, tests=300,
                                                             fla=120), tests_workers=0)
WINDOW = 64  # sinks 8 + window 56: a 64-token cache; cuDNN's local window of the same size


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
    """pytest on the GPU tests, gradients first, with pytest-xdist's workers where a GPU is here. A row
    per test as pytest reports it, each failure's message as it happens, then the total."""
    import importlib.util as iu
    import re

    env = dict(os.environ, LINJAX_INSTANT_FAILURES="1")
    if not args.smoke:
        env["LINJAX_TESTS_GPU"] = "1"
    workers = ["-n", str(sizes["tests_workers"])] if iu.find_spec("xdist") is not None else []
    outcome_re = re.compile(r"(?:(PASSED|FAILED|ERROR|SKIPPED)\s+(tests/\S+::\S+))"
                            r"|(?:(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED))")
    start = time.perf_counter()
    counts, seen = {}, set()
    for selection in ("grad or backward", "not (grad or backward)"):   # the gradients first
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/kernels/test_gpu.py",
                   "-k", selection, *workers]
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=env)
        for line in process.stdout:
            line = line.rstrip()
            if line.startswith("INSTANT-FAILURE ") and " :: " in line:  # tests/conftest.py, as each test fails
                test, message = line[len("INSTANT-FAILURE "):].split(" :: ", 1)
                append_row(args.out, dict(part="tests", test=test.split("::")[-1], outcome="message", message=message))
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
        process.wait()
    failed = counts.get("failed", 0) + counts.get("error", 0)
    append_row(args.out, dict(part="tests", test="(all)", outcome="passed" if not failed else f"{failed} failed",
                              seconds=time.perf_counter() - start, counts=counts))


def _relative_rms(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm else float(np.linalg.norm(a))


def part_kernels(args, sizes, T: int):
    """Every kernel of bench/programs.py, Pallas (and, at the shorter length, XLA's `chunked`), forward and
    forward + backward, the Pallas output compared with chunked's; cuDNN's softmax, full and windowed."""
    import jax
    import jax.numpy as jnp

    programs = _sibling("programs")
    B, H, D = (sizes["kernel_shape"][k] for k in "BHD")
    dtype = jnp.dtype(sizes["dtype"])
    long = sizes["short_T"] < T
    on_gpu = jax.default_backend() == "gpu"
    for mech in programs.KERNELS:
        arrays = programs.kernel_inputs(mech, B, T, H, D, dtype, key=jax.random.key(T))
        expected = None if long else jax.jit(programs.kernel_program(mech, "chunked", False))(*arrays)
        for form in ("pallas",) if long else ("pallas", "chunked"):
            row = dict(part="kernels", mech=mech, kernel=form, T=T, B=B, H=H, D=D, dtype=str(dtype))
            try:
                forward = jax.jit(programs.kernel_program(mech, form, False))
                backward = jax.jit(programs.kernel_program(mech, form, True))
                row["forward_first_s"], row["forward_s"] = timed(lambda: forward(*arrays), jax.block_until_ready,
                                                                 sizes["kernel_repeats"])
                row["forward_backward_first_s"], row["forward_backward_s"] = timed(
                    lambda: backward(*arrays), jax.block_until_ready, sizes["kernel_repeats"])
                if expected is not None and form == "pallas":
                    row["relative_rms_vs_chunked"] = _relative_rms(forward(*arrays).astype(jnp.float32),
                                                                   expected.astype(jnp.float32))
            except Exception as error:  # one method's failure is a result, not the end of the part
                row["error"] = error_text(error)
            append_row(args.out, row)
    q, k, v = programs.kernel_inputs("sinks_window", B, T, H, D, dtype, key=jax.random.key(T))
    impl = "cudnn" if on_gpu and dtype != jnp.float32 else "xla"
    for label, window in (("softmax, full causal", None), (f"softmax, local window {WINDOW}", (WINDOW - 1, 0))):
        row = dict(part="kernels", mech=label, kernel=impl, T=T, B=B, H=H, D=D, dtype=str(dtype))
        fn = lambda q, k, v, window=window: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=impl, local_window_size=window)
        try:
            forward = jax.jit(fn)
            backward = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
            row["forward_first_s"], row["forward_s"] = timed(lambda: forward(q, k, v), jax.block_until_ready,
                                                             sizes["kernel_repeats"])
            row["forward_backward_first_s"], row["forward_backward_s"] = timed(
                lambda: backward(q, k, v), jax.block_until_ready, sizes["kernel_repeats"])
        except Exception as error:
            row["error"] = error_text(error)
        append_row(args.out, row)


def part_fla(args, sizes):
    """FLA's chunk kernels (Triton through PyTorch) with the first configuration of each autotuning list."""
    try:
        import torch
        import triton
    except ImportError as error:
        append_row(args.out, dict(part="fla", error=f"not run: {error_text(error)}"))
        return
    autotune = triton.autotune
    triton.autotune = lambda configs, *a, **kw: autotune(configs[:1], *a, **kw)   # untuned: one configuration
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
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
    for T in (sizes["short_T"], sizes["long_T"]):
        gen = torch.Generator(device="cuda").manual_seed(T)
        randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
        q, k = (torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).bfloat16() for _ in range(2))
        v = randn(B, T, H, D).bfloat16()
        g = torch.nn.functional.logsigmoid(randn(B, T, H, D) + 3.0)
        beta = torch.sigmoid(randn(B, T, H))
        runs = (("chunk_gated_delta_rule", chunk_gated_delta_rule, (q, k, v, g[..., 0], beta)),
                ("chunk_kda", chunk_kda, (q, k, v, g, beta)), ("chunk_gla", chunk_gla, (q, k, v, g)))
        for name, kernel, inputs in runs:
            row = dict(part="fla", mech=name, kernel="FLA, untuned (first autotune configuration)", T=T, B=B, H=H,
                       D=D, dtype="bfloat16")
            try:
                row["forward_first_s"], row["forward_s"] = timed(lambda: kernel(*inputs), sync, sizes["kernel_repeats"])
                leaves = [x.detach().requires_grad_() for x in inputs]
                row["forward_backward_first_s"], row["forward_backward_s"] = timed(
                    lambda: kernel(*leaves)[0].float().sum().backward(), sync, sizes["kernel_repeats"])
            except Exception as error:
                row["error"] = error_text(error)
            append_row(args.out, row)


def part_train(args, sizes, model: str, batch: int, tokens: int, layers: int | None):
    """One training step of the final recipe, built by bench/programs.py as `linjax train` builds it."""
    import gc

    import jax

    from linjax.experiment import ModelSection, TrainSection
    from linjax.train import sharding

    programs = _sibling("programs")
    started = time.perf_counter()
    settings = TrainSection(steps=100, seq_len=tokens, batch_size=batch, warmup_steps=10)
    total_layers = programs.MODELS[model]["num_hidden_layers"]
    layers = layers or total_layers
    row = dict(part="train", model=model, what="recipe", batch=batch, T=tokens, layers=layers,
               total_layers=total_layers,
               dtype=ModelSection().dtype, remat=settings.remat, loss_chunk=settings.loss_chunk_size())
    try:
        mesh = sharding.make_mesh()
        step, (trainable, opt_state, frozen, batch_tokens) = programs.train_step_program(
            model, batch, tokens, "recipe", mesh, abstract=False, settings=settings, layers=layers)
        row["built_s"] = time.perf_counter() - started
        start = time.perf_counter()
        compiled = step.lower(trainable, opt_state, frozen, batch_tokens).compile()
        row["compile_s"] = time.perf_counter() - start
        memory = compiled.memory_analysis()
        if memory is not None:
            row["compiled_temp_bytes"] = int(memory.temp_size_in_bytes)
        state, losses, norms = [trainable, opt_state], [], []

        def call():
            new_trainable, new_opt_state, metrics = compiled(*state, frozen, batch_tokens)
            state[:] = [new_trainable, new_opt_state]
            return metrics

        def sync(metrics):
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))

        gc.collect()
        first_call, row["median_step_s"] = timed(call, sync, sizes["train_repeats"])
        row["first_step_s"] = row["compile_s"] + first_call  # compilation included, as `linjax train` pays it
        row["losses"], row["grad_norms"] = losses, norms
        row["tokens_per_s"] = batch * tokens / row["median_step_s"]
        full_step = row["median_step_s"] * total_layers / layers
        row["projected_paper_run_h"] = PAPER_STEPS * full_step / 3600
    except Exception as error:
        row["error"] = error_text(error)
    with contextlib.suppress(Exception):  # CPU devices have no memory statistics
        row["peak_bytes_in_use"] = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
    append_row(args.out, row)


def part_torch(args, sizes):
    """PyTorch's floor: the frozen model's loss and its gradient to the input embeddings (SDPA)."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        append_row(args.out, dict(part="torch", error=f"not run: {error_text(error)}"))
        return
    programs = _sibling("programs")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    for model, batch, tokens, dtype_name in sizes["torch"]:
        shapes = programs.MODELS[model]
        row = dict(part="torch", model=model, what="floor (SDPA)", batch=batch, T=tokens, dtype=dtype_name,
                   device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
        try:
            dtype = getattr(torch, dtype_name)
            config = LlamaConfig(vocab_size=shapes["vocab_size"], hidden_size=shapes["hidden_size"],
                                 intermediate_size=shapes["intermediate_size"],
                                 num_hidden_layers=shapes["num_hidden_layers"],
                                 num_attention_heads=shapes["num_attention_heads"],
                                 num_key_value_heads=shapes["num_key_value_heads"], head_dim=shapes["head_dim"],
                                 rms_norm_eps=shapes["rms_norm_eps"],
                                 tie_word_embeddings=shapes.get("tie_word_embeddings", False),
                                 max_position_embeddings=max(tokens, 8192), attn_implementation="sdpa")
            torch.manual_seed(0)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    net = LlamaForCausalLM(config).eval()
            finally:
                torch.set_default_dtype(default_dtype)
            for p in net.parameters():
                p.requires_grad_(False)
            ids = torch.randint(0, shapes["vocab_size"], (batch, tokens), device=device)

            def floor():
                embeds = net.get_input_embeddings()(ids).detach().requires_grad_(True)
                net(inputs_embeds=embeds, labels=ids).loss.backward()
                return embeds.grad

            row["first_step_s"], row["median_step_s"] = timed(floor, sync, sizes["train_repeats"])
            row["tokens_per_s"] = batch * tokens / row["median_step_s"]
            if device == "cuda":
                row["peak_bytes_in_use"] = torch.cuda.max_memory_allocated()
        except Exception as error:
            row["error"] = error_text(error)
        append_row(args.out, row)


# ------------------------------------------------------------------------------------------- driver


def schedule(sizes) -> list[tuple[str, list[str], float]]:
    """[(label, part argv, limit s)] in running order (the module docstring's)."""
    train = [(f"train {m} {b}x{t}", ["train", m, str(b), str(t)], limit) for m, b, t, limit in sizes["train"]]
    limits = sizes["limits"]
    return [train[0], ("torch", ["torch"], limits["torch"]), *train[1:2],
            (f"kernels T {sizes['short_T']}", ["kernels", str(sizes["short_T"])], limits["kernels"]),
            ("tests", ["tests"], limits["tests"]),
            (f"kernels T {sizes['long_T']}", ["kernels", str(sizes["long_T"])], limits["long_kernels"]),
            *train[2:], ("fla", ["fla"], limits["fla"])]


def run_part(args, label, part_argv, limit, env, log) -> tuple[int | None, float]:
    """Runs one part in a process group of its own; (exit status, or None past its limit; seconds). At the
    limit the part and what it started (pytest and its workers) end together."""
    command = [sys.executable, os.path.abspath(__file__), "--part", *part_argv, "--out", args.out]
    if limit > 10:  # the part writes every thread's stack to the log just before its limit: where it was
        command += ["--stacks-after", f"{limit - 4:.0f}"]
    if args.smoke:
        command.append("--smoke")
    print(f"== {label} (limit {limit:.0f} s)", flush=True)
    log.write(f"== {label} (limit {limit:.0f} s)\n")
    log.flush()
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log)
    try:
        status = process.wait(timeout=max(limit, 0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = None
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
    plan = [p for p in schedule(sizes) if wanted is None or p[1][0] in wanted]
    with open(os.path.join(args.out, "gpu_check.log"), "a") as log:
        while plan:
            label, part_argv, limit = plan.pop(0)
            left = budget - (time.perf_counter() - started)
            if left < 10:
                runs.append(dict(part=label, status="not run: the budget was spent"))
                continue
            seen = len(read_rows(args.out))
            status, seconds = run_part(args, label, part_argv, min(limit, left), env, log)
            runs.append(dict(part=label, status="timed out" if status is None else f"exit {status}", seconds=seconds))
            new_rows = read_rows(args.out)[seen:]
            if part_argv[0] == "train" and part_argv[1].startswith("llama") and any(map(out_of_memory, new_rows)):
                layers = min(r["layers"] for r in new_rows) // 2
                if layers >= 2:  # the largest depth that fits, halving
                    plan.insert(0, (f"{label} ({layers} layers)", part_argv[:4] + [str(layers)], limit))
            write_report(args, runs, time.perf_counter() - started)
    print(markdown(report(args, runs, time.perf_counter() - started)))


def deviceless_rows() -> dict:
    """The latest committed deviceless compile of each program (results/bench/compile-gpu-*/), by name."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "bench", "compile-gpu-*", "compile.jsonl"))):
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    found[row["program"]] = row
    return found


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
    train = [r for r in rows if r["part"] in ("train", "torch")]
    if train:
        compiled_here = deviceless_rows()
        lines += ["", "## Training steps (random weights)", "",
                  "| framework | model | batch × T | layers | median step s | first step s (compile s) | tokens/s | "
                  "losses | peak GiB (compiled temp GiB) | deviceless compile s / total GiB | 2,500-step run h |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            name = ("linjax, final recipe" if r["part"] == "train"
                    else f"PyTorch, {r.get('what', '')} {r.get('dtype', '')}")
            aot = compiled_here.get(f"train/{r.get('model')}/recipe/{r.get('batch')}x{r.get('T')}@h100") \
                if r["part"] == "train" else None
            aot_text = f"{aot['compile_s']:.1f} / {aot['total_bytes'] / 2**30:.1f}" if aot and "compile_s" in aot \
                and "total_bytes" in aot else "–"
            losses = ", ".join(f"{x:.3f}" for x in r.get("losses", [])[:3]) or "–"
            lines.append(f"| {name}{err(r)} | {r.get('model', '')} | {r.get('batch', '')} × {r.get('T', '')} | "
                         f"{r.get('layers', '')} | {s(r, 'median_step_s')} | {s(r, 'first_step_s')} "
                         f"({s(r, 'compile_s')}) | {r.get('tokens_per_s', 0):,.0f} | {losses} | "
                         f"{gb(r, 'peak_bytes_in_use')} ({gb(r, 'compiled_temp_bytes')}) | {aot_text} | "
                         f"{s(r, 'projected_paper_run_h')} |")
    kernels = [r for r in rows if r["part"] in ("kernels", "fla")]
    if kernels:
        lines += ["", "## Kernels", "", "| mechanism | method | T | forward ms | forward + backward ms | "
                  "first forward s | first forward + backward s | relative RMS against chunked |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in kernels:
            rms = f"{r['relative_rms_vs_chunked']:.1e}" if "relative_rms_vs_chunked" in r else "–"
            lines.append(f"| {r.get('mech', '')} | {r.get('kernel', 'FLA')}{err(r)} | {r.get('T', '')} | "
                         f"{ms(r, 'forward_s')} | {ms(r, 'forward_backward_s')} | {s(r, 'forward_first_s')} | "
                         f"{s(r, 'forward_backward_first_s')} | {rms} |")
    tests = [r for r in rows if r["part"] == "tests"]
    if tests:
        lines += ["", "## GPU tests (tests/kernels/test_gpu.py, gradients first)", "",
                  "| test | outcome | s since the start |", "|---|---|---|"]
        lines += [f"| {r['test']} | {r['outcome']}{' ' + r['message'] if r.get('message') else ''}"
                  f"{' ' + str(r['counts']) if r.get('counts') else ''} | "
                  f"{r.get('seconds', r.get('seconds_since_start', 0)):.1f} |" for r in tests]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rows.jsonl, gpu_check.json, .md and .log")
    p.add_argument("--smoke", action="store_true", help="every part at tiny shapes; runs on a CPU")
    p.add_argument("--budget", type=float, default=None, help="seconds for all parts together (default 420)")
    p.add_argument("--parts", default=None, help="comma-separated subset of: train,torch,kernels,tests,fla")
    p.add_argument("--cache", default="~/.cache/linjax-gpu-check", help="JAX and Triton compilation caches")
    p.add_argument("--part", nargs="+", default=None, help=argparse.SUPPRESS)  # one part, in a child process
    p.add_argument("--stacks-after", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.parts and not set(args.parts.split(",")) <= {"tests", "train", "torch", "kernels", "fla"}:
        sys.stderr.write(f"gpu_check: --parts takes train, torch, kernels, tests, fla; got {args.parts!r}\n")
        sys.exit(2)
    if args.part is None:
        if not args.smoke and not _cuda_visible():
            sys.stderr.write("gpu_check: no CUDA GPU here (nvidia-smi finds none); --smoke runs the parts at tiny "
                             "shapes on any machine\n")
            sys.exit(2)
        return driver(args)
    sizes = SMOKE if args.smoke else FULL
    if args.stacks_after:
        import faulthandler
        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    name, *rest = args.part
    if name == "tests":
        part_tests(args, sizes)
    elif name == "kernels":
        part_kernels(args, sizes, int(rest[0]))
    elif name == "fla":
        part_fla(args, sizes)
    elif name == "torch":
        part_torch(args, sizes)
    elif name == "train":
        model, batch, tokens = rest[:3]
        part_train(args, sizes, model, int(batch), int(tokens), int(rest[3]) if len(rest) > 3 else None)


def _cuda_visible() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if __name__ == "__main__":
    main()
