"""One point of the latency benchmark (eval/latency.py): one implementation at one prompt length L.

Run as its own process (`python .../linjax/eval/latency_point.py --one IMPL --length L ...`, by
file path so that the transformers point never imports JAX) so that its peak memory is its own
and an out-of-memory kill ends only this point. The process:

1. loads the model, and for linjax compiles the decode step from shapes alone;
2. hands freed allocator memory back to the OS, notes its resident set (`baseline_rss_bytes`)
   and resets the high-water mark, so the peak it reports (`peak_rss_bytes`) covers the decode
   state, the prefill if one runs, and decoding, while one-off load and compile transients stay
   in `load_peak_rss_bytes`; on a GPU also the device's bytes in use then (`baseline_device_bytes`)
   and its peak over the whole process (`peak_device_bytes`: JAX cannot reset it; weights included);
3. builds the state a prefill of L tokens leaves: by running that prefill (`--real-prefill`) or,
   by default, as a random stand-in of the same shapes with its token counters set to L;
4. decodes `decode_tokens` greedy tokens once untimed, then `repeats` timed times, rewinding the
   cache to L tokens after each run (the paper times the 16 decode steps end to end);
5. writes its measurements as JSON to `--result`.

Module-level imports are the standard library only; JAX and torch are imported by the function
that measures with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

IMPLEMENTATIONS = {
    "full": "linjax full attention (KV cache)",
    "linearized": "linjax linearized (GDN + w56 + s8 + short conv)",
    "retained": "linjax linearized with retained tokens (GDN + w56 + s8 + short conv + retain)",
    "transformers": "transformers LlamaForCausalLM (DynamicCache)",
}
LINJAX_IMPLEMENTATIONS = ("full", "linearized", "retained")
DEFAULT_RETAIN, DEFAULT_RETAIN_SCORE = 64, "recall"  # the retention runs' 128-token budget: 8 + 56 + 64


def implementation_label(implementation: str, retain: int = DEFAULT_RETAIN,
                         retain_score: str = DEFAULT_RETAIN_SCORE) -> str:
    """How tables name an implementation; the retained one says how many tokens it keeps, and by what."""
    if implementation == "retained":
        return f"linjax linearized + {retain} retained by {retain_score} (GDN + w56 + s8 + short conv)"
    return IMPLEMENTATIONS[implementation]


# ----------------------------------------------------------------------------- memory readings


def proc_status_bytes(field: str) -> int | None:
    """A `kB` line of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Sets VmHWM back to the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def volunteer_for_oom_killer() -> None:
    """Makes this process the out-of-memory killer's first choice, so a point that does not fit
    dies alone instead of taking down whatever else runs on the machine."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def release_freed_memory() -> None:
    """Returns the blocks that loading and compiling freed, but glibc's allocator kept, to the OS
    (malloc_trim), so the baseline and the peak count memory in use rather than a cache of it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the numbers include the allocator's cache


def memory_before_state(device_bytes) -> dict:
    """What the process holds before the decode state exists (weights, runtime, compiled code);
    then resets the peak so the reported one covers the state, the prefill (if real) and decoding."""
    release_freed_memory()
    before = {"load_peak_rss_bytes": proc_status_bytes("VmHWM"), "baseline_rss_bytes": proc_status_bytes("VmRSS")}
    before["peak_rss_scope"] = ("from just before the state was allocated" if reset_peak_rss()
                                else "whole process (VmHWM could not be reset)")
    device = device_bytes()
    if device is not None:
        before["baseline_device_bytes"] = device[0]
    return before


def memory_after(before: dict, device_bytes) -> dict:
    """`before` plus the peaks reached since (the device's: since the process started)."""
    after = dict(before, peak_rss_bytes=proc_status_bytes("VmHWM"))
    device = device_bytes()
    if device is not None:
        after["peak_device_bytes"] = device[1]
    return after


def kv_cache_bytes(hf_config: dict, batch: int, tokens: int, itemsize: int = 4) -> int:
    """Bytes of keys and values for `tokens` positions in every layer (fp32 by default)."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_heads = hf_config.get("num_key_value_heads") or heads
    return 2 * hf_config["num_hidden_layers"] * batch * tokens * kv_heads * head_dim * itemsize


# ----------------------------------------------------------------------------- timing


def time_decode(decode_once, rewind, repeats: int) -> list[float]:
    """Seconds of `decode_once` (all decode steps, finished), `repeats` times after one untimed warm-up.

    The warm-up has the timed shapes, so it absorbs first-touch page faults and kernel selection;
    `rewind` returns the cache to L tokens after each run, so every run decodes positions L .. L+15.
    """
    decode_once()
    rewind()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode_once()
        seconds.append(time.perf_counter() - start)
        rewind()
    return seconds


# ----------------------------------------------------------------------------- linjax


def linearized_recipe(retain: int = 0, retain_score: str = DEFAULT_RETAIN_SCORE):
    """The paper's final recipe (sec. 4): GDN, sliding window 56 + 8 sink tokens, short convolution;
    with `retain` > 0, that many tokens per layer and kv head kept for their content (docs/retention.md)."""
    import linjax

    return linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv", retain=retain,
                                  retain_score=retain_score)


def linearize_settings(implementation: str, retain: int = DEFAULT_RETAIN, retain_score: str = DEFAULT_RETAIN_SCORE):
    """The LinearizeConfig of a linjax implementation (None: full attention)."""
    if implementation not in LINJAX_IMPLEMENTATIONS:
        raise ValueError(f"{implementation!r} is not a linjax implementation; expected one of "
                         f"{', '.join(LINJAX_IMPLEMENTATIONS)}")
    if implementation == "full":
        return None
    return linearized_recipe(retain, retain_score) if implementation == "retained" else linearized_recipe()


def build_linjax_model(source: str, implementation: str, seed: int = 0, retain: int = DEFAULT_RETAIN,
                       retain_score: str = DEFAULT_RETAIN_SCORE):
    """The model of one linjax implementation: `source` as loaded, or linearized with the recipe
    (`retain` and `retain_score` apply to "retained" only)."""
    import linjax

    settings = linearize_settings(implementation, retain, retain_score)
    model, _ = linjax.load(source)
    if model.linearize_config is not None:
        raise ValueError(f"{source} is already linearized; the benchmark starts from the full-attention model")
    return model if settings is None else linjax.linearize(model, settings, seed=seed)


def cache_bytes_per_layer(hf_config: dict, implementation: str, batch: int, tokens: int,
                          retain: int = DEFAULT_RETAIN, retain_score: str = DEFAULT_RETAIN_SCORE) -> list[int]:
    """Bytes of each layer's decode cache for `batch` sequences of up to `tokens` tokens, from the
    cache shapes alone: the model is built and its states made inside `jax.eval_shape`, so no weight
    or cache is allocated and nothing is timed."""
    import jax
    from flax import nnx

    import linjax
    from linjax.config import ModelConfig
    from linjax.model import CausalLM

    config, settings = ModelConfig.from_hf(hf_config), linearize_settings(implementation, retain, retain_score)

    def states():
        model = CausalLM(config, rngs=nnx.Rngs(0))
        model = model if settings is None else linjax.linearize(model, settings)
        return model.init_states(batch, tokens)

    return [state_bytes(layer) for layer in jax.eval_shape(states)]


def state_shapes(model, batch: int, max_length: int):
    """The decode states `model.init_states` would build, as shapes only (no memory)."""
    import jax

    return jax.eval_shape(lambda: model.init_states(batch, max_length))


def state_bytes(states) -> int:
    """Bytes of a state pytree (arrays or shapes)."""
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(states))


def _is_retained(node) -> bool:
    from linjax.kernels.retention import RetainedCache

    return isinstance(node, RetainedCache)


def with_length(states, length: int):
    """`states` with every token counter (KVCache.length, LinearState.length, WindowCache.length) set
    to `length`: positions continue at `length`, and a window ring counts as full. Retained tokens'
    positions are kept: they say which slots hold a token, not how many tokens were seen."""
    import jax
    import jax.numpy as jnp

    def set_counter(x):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            return x
        if x.shape != ():
            raise ValueError(f"expected token counters to be integer scalars, found an integer array {x.shape}; "
                             "the random stand-in does not know how to fill it")
        return jnp.asarray(length, x.dtype)

    def visit(node):
        return node if _is_retained(node) else set_counter(node)

    return jax.tree.map(visit, states, is_leaf=_is_retained)


def random_states(shapes, length: int, seed: int = 0):
    """A stand-in for the states a prefill of `length` tokens leaves: the given shapes, random values.

    Floats are N(0, 1/d) over a last axis of size d, so rows have about unit norm like the
    L2-normalised keys of the linear part, and gate rings (log α, β) stay near 0: 16 decode steps
    stay finite. Drawn on the host with NumPy one array at a time, each straight in its final shape:
    no compiled program (compiling one that draws the ~400 arrays of a linearized state left more
    memory behind than the state itself), and nothing here grows with L for a linear layer.
    Retained slots are all full, as after a long prompt: slot r of every kv head holds position r.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def draw(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x  # a token counter: `with_length` sets it
        values = rng.standard_normal(x.shape, dtype=np.float32)
        values *= np.float32(x.shape[-1] ** -0.5 if x.shape else 1.0)
        return jnp.asarray(values, x.dtype)

    def fill(node):
        if not _is_retained(node):
            return draw(node)
        batch, slots, kv_heads = node.position.shape
        position = np.broadcast_to(np.arange(slots, dtype=np.int32)[None, :, None], (batch, slots, kv_heads))
        return node._replace(entries=jax.tree.map(draw, node.entries), score=draw(node.score),
                             position=jnp.asarray(position, node.position.dtype))

    return with_length(jax.tree.map(fill, shapes, is_leaf=_is_retained), length)


def greedy_step_function(model):
    """(jitted step, params): step(params, tokens [B,T], states) → (next tokens [B,1], new states).

    T > 1 is a prefill, T = 1 one decode step. Only the last position's logits are formed (a
    prefill's [B, L, vocab] logits would be larger than its KV cache), and the states are donated
    so XLA writes the cache in place instead of copying it every step.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params = nnx.split(model)

    def step(params, tokens, states):
        model = nnx.merge(graphdef, params)
        hidden, states = model.hidden_states(tokens, states=states)
        logits = model.logits(hidden[:, -1])
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], states

    return jax.jit(step, donate_argnums=2), params


def jax_device_bytes():
    """(bytes in use, peak bytes in use) of the first JAX device, or None where it keeps no stats (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["bytes_in_use"], stats["peak_bytes_in_use"]


def measure_linjax(implementation: str, *, source: str, length: int, batch: int, decode_tokens: int,
                   repeats: int, real_prefill: bool, seed: int = 0, retain: int = DEFAULT_RETAIN,
                   retain_score: str = DEFAULT_RETAIN_SCORE) -> dict:
    """One point for a linjax implementation (steps 1-4 of the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    model = build_linjax_model(source, implementation, seed, retain, retain_score)
    step, params = greedy_step_function(model)
    shapes = state_shapes(model, batch, length + decode_tokens)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    # Compiled from shapes alone, before any state exists: compilation is not part of the peak.
    decode = step.lower(params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), shapes).compile()
    if real_prefill:
        prefill = step.lower(params, jax.ShapeDtypeStruct((batch, length), jnp.int32), shapes).compile()
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(seed)
    memory = memory_before_state(jax_device_bytes)

    prefill_s = None
    if real_prefill:
        prompt = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
        start = time.perf_counter()
        empty = model.init_states(batch, length + decode_tokens)
        token, states = jax.block_until_ready(prefill(params, prompt, empty))
        prefill_s = time.perf_counter() - start
    else:
        states = jax.block_until_ready(random_states(shapes, length, seed))
        token = jnp.asarray(rng.integers(0, vocab, (batch, 1)), jnp.int32)
    carry = {"token": token, "states": states}

    def decode_once():
        token, states = carry["token"], carry["states"]
        for _ in range(decode_tokens):
            token, states = decode(params, token, states)
        carry.update(token=jax.block_until_ready(token), states=jax.block_until_ready(states))

    def rewind():
        carry["states"] = with_length(carry["states"], length)

    seconds = time_decode(decode_once, rewind, repeats)
    device = jax.devices()[0]
    return dict(memory_after(memory, jax_device_bytes), decode_s_runs=seconds, compile_s=compile_s,
                prefill_s=prefill_s, state_bytes=state_bytes(shapes),
                device=f"{device.platform}: {device.device_kind}", threads=len(os.sched_getaffinity(0)))


# ----------------------------------------------------------------------------- transformers


def random_dynamic_cache(model, batch: int, length: int, seed: int = 0):
    """A transformers DynamicCache holding `length` random keys and values [B, Hkv, L, D] per layer.

    Filled through the public `Cache.update(keys, values, layer_idx)`, one layer at a time, so at
    most one layer's random tensors exist beside the cache.
    """
    import torch
    from transformers import DynamicCache

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, config.num_key_value_heads, length, head_dim)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator, device=model.device, dtype=model.dtype)
                        * head_dim ** -0.5 for _ in range(2))
        cache.update(keys, values, layer)
    return cache


def measure_transformers(*, hf_dir: str, length: int, batch: int, decode_tokens: int, repeats: int,
                         real_prefill: bool, seed: int = 0, threads: int | None = None) -> dict:
    """One point for transformers' own model: float32, `torch.no_grad()`, greedy, its DynamicCache.

    `threads`: torch's intra-op threads (the process's cores when run by `point_main`)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    if threads:
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    generator = torch.Generator(device=device).manual_seed(seed)

    def random_tokens(count):
        return torch.randint(0, model.config.vocab_size, (batch, count), generator=generator, device=device)

    def cuda_bytes():
        return (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) if device == "cuda" else None

    def finish():
        if device == "cuda":
            torch.cuda.synchronize()

    def greedy(tokens, cache, **positions):
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1, **positions)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        memory = memory_before_state(cuda_bytes)
        prefill_s = None
        if real_prefill:
            start = time.perf_counter()
            cache = DynamicCache()
            token = greedy(random_tokens(length), cache)
            finish()
            prefill_s = time.perf_counter() - start
        else:
            cache, token = random_dynamic_cache(model, batch, length, seed), random_tokens(1)
        carry = {"token": token}

        def decode_once():
            token = carry["token"]
            for i in range(decode_tokens):
                # Positions continue at L; DynamicCache appends each step's keys and values.
                token = greedy(token, cache, position_ids=torch.full((batch, 1), length + i, device=device))
            finish()
            carry["token"] = token

        def rewind():
            # A negative count removes that many tokens (the meaning in transformers 4.x and 5.x).
            cache.crop(-(cache.get_seq_length() - length))

        seconds = time_decode(decode_once, rewind, repeats)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return dict(memory_after(memory, cuda_bytes), decode_s_runs=seconds, compile_s=None, prefill_s=prefill_s,
                state_bytes=kv_cache_bytes(model.config.to_dict(), batch, length + decode_tokens),
                device=f"{device}: {name}", threads=torch.get_num_threads(), model_class=type(model).__name__,
                attn_implementation=getattr(model.config, "_attn_implementation", None))


# ----------------------------------------------------------------------------- the process


def use_cores(count: int) -> None:
    """Pins this process to `count` of its cores before JAX or torch start: XLA sizes its thread pool
    from the cores it may use, and torch is told the same number, so both frameworks get equal threads."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= count <= len(cores):
        raise ValueError(f"threads must be between 1 and the {len(cores)} cores this process may use, got {count}")
    os.sched_setaffinity(0, cores[:count])
    os.environ["OMP_NUM_THREADS"] = str(count)


def point_main(argv) -> None:
    """Measures the point that `argv` describes and writes it as JSON to --result."""
    p = argparse.ArgumentParser(prog="latency_point.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--one", required=True, choices=list(IMPLEMENTATIONS))
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--hf-dir")
    p.add_argument("--real-prefill", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--retain", type=int, default=DEFAULT_RETAIN)
    p.add_argument("--retain-score", default=DEFAULT_RETAIN_SCORE)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    volunteer_for_oom_killer()
    if args.threads:
        use_cores(args.threads)
    common = {"length": args.length, "batch": args.batch, "decode_tokens": args.decode_tokens,
              "repeats": args.repeats, "real_prefill": args.real_prefill, "seed": args.seed}
    if args.one == "transformers":
        point = measure_transformers(hf_dir=args.hf_dir, threads=len(os.sched_getaffinity(0)), **common)
    else:
        point = measure_linjax(args.one, source=args.model, retain=args.retain, retain_score=args.retain_score,
                               **common)
    write_atomic(args.result, json.dumps(point))


def write_atomic(path: str, text: str) -> None:
    """Writes through a temporary file, so a reader never sees half of it. Not linjax.files.write_text:
    this process must not import the linjax package (it imports JAX, see the module's docstring)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    import sys

    # Run as a file, this folder is sys.path[0]; its data.py, models.py, ... must not shadow other packages.
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    point_main(sys.argv[1:])
