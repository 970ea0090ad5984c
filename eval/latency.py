"""Decode latency and peak memory against context length: full attention with a KV cache vs the linearized model.

The paper's protocol (sec. 3.3, "Latency, Memory, and Approximation Error", and the appendix's
"Latency and memory"): batch 8; for each prompt length L run a forward pass over the prompt,
then decode 16 new tokens; report the end-to-end time of those 16 steps and the peak memory of
the run. Implementations of the same weights (the first, second and fourth run by default):

    full          linjax, softmax attention over a preallocated KV cache [B, Hkv, L+16, D] per layer
    linearized    linjax, GDN + window 56 + sinks 8 + short conv (the paper's final recipe; its new
                  parameters are untrained, which does not change the work per token)
    retained      linearized, plus `retain` tokens per layer and kv head kept for their content
                  (default 64 by "recall"; --retain, --retain-score; docs/retention.md)
    transformers  transformers' own model with its DynamicCache: what a user would otherwise run

Beside the timings, the decode cache's bytes per layer at each L for the linjax implementations,
from the cache shapes (deterministic, not measured): a KV cache grows with L; the linear state,
with or without retained tokens, does not.

Only the decode steps are timed, so by default a random stand-in replaces the prefill: the
decode state of the right shapes with random values and its token counters set to L (a batch-8
prefill at 32k tokens takes very long on a CPU). `real_prefill=True` runs the real prefill; the
JSON records which was used. linjax decode steps are jitted with the state donated, so the KV
cache is updated in place, as a serving loop would.

Every (implementation, L) point runs in a fresh process (latency_point.py, which describes what
is measured), so its peak memory is its own, and an out-of-memory kill is recorded as "did not
fit" instead of ending the benchmark. L grows per implementation until a point does not fit; a
KV-cache point whose cache alone exceeds the available memory is not started.

    python bench/latency.py --lengths 1024,2048 --out results/bench/latency
    linjax bench latency --lengths 1024,2048,4096,8192,16384,32768 --out results/latency
    linjax bench latency --implementations linearized,retained --retain 64 --retain-score recall
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata

import linjax
from linjax.eval import latency_point
from linjax.eval.latency_point import (
    DEFAULT_RETAIN,
    DEFAULT_RETAIN_SCORE,
    IMPLEMENTATIONS,
    LINJAX_IMPLEMENTATIONS,
    cache_bytes_per_layer,
    implementation_label,
    kv_cache_bytes,
)
from linjax.files import pyplot, write_figure, write_json, write_text

KV_CACHE_IMPLEMENTATIONS = ("full", "transformers")  # state grows with L: checked against free memory first
LINEAR_IMPLEMENTATIONS = ("linearized", "retained")  # state fixed in L: their peak memory should be flat
DEFAULT_IMPLEMENTATIONS = ("full", "linearized", "transformers")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
BATCH = 8  # the paper's batch
DECODE_TOKENS = 16  # the paper times 16 new tokens
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_HF_DIRS = {"smollm2-135m": os.path.join("runs", "smollm2-hf")}
STAND_IN = "random stand-in"
GIB = 2 ** 30


# ----------------------------------------------------------------------------- input checks


def parse_lengths(text) -> list[int]:
    """'1024,2048' (or a list of ints) → [1024, 2048]; each must be a positive integer."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        lengths = [int(x) for x in items if str(x).strip()]
    except ValueError:
        raise ValueError(f"lengths must be comma-separated positive integers like '1024,2048', got {text!r}") from None
    if not lengths or any(n <= 0 for n in lengths):
        raise ValueError(f"lengths must be positive integers like '1024,2048', got {text!r}")
    return lengths


def retention_settings(implementations, retain: int | None, retain_score: str | None) -> dict | None:
    """{"retain", "retain_score"} of the "retained" implementation (defaults filled in), or None when it
    does not run; refuses retention settings given without it, and a retain below 1."""
    if "retained" not in implementations:
        if retain is not None or retain_score is not None:
            raise ValueError("--retain and --retain-score set the 'retained' implementation; add it to "
                             "--implementations, e.g. full,linearized,retained")
        return None
    settings = {"retain": DEFAULT_RETAIN if retain is None else retain,
                "retain_score": DEFAULT_RETAIN_SCORE if retain_score is None else retain_score}
    from linjax.linearize import RETAIN_SCORES

    if not isinstance(settings["retain"], int) or settings["retain"] < 1:
        raise ValueError(f"retain must be a positive integer (tokens per layer and kv head), "
                         f"got {settings['retain']!r}")
    if settings["retain_score"] not in RETAIN_SCORES:
        raise ValueError(f"unknown retain_score {settings['retain_score']!r}; choose from {', '.join(RETAIN_SCORES)}")
    return settings


def parse_implementations(text) -> list[str]:
    """'full,linearized' (or a list) → the keys of IMPLEMENTATIONS, in the order given."""
    names = [x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown or not names:
        raise ValueError(f"unknown implementation(s) {unknown or names}; choose from {', '.join(IMPLEMENTATIONS)}")
    return names


def available_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def mem_available_bytes() -> int | None:
    """The kernel's estimate of memory available to a new process (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- one point, in its own process


OUT_OF_MEMORY_SIGNS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError", "OutOfMemoryError",
                       "std::bad_alloc", "Cannot allocate memory")


def failed_point(returncode: int, stderr: str) -> dict:
    """status and reason for a point process that ended without a result."""
    tail = stderr.strip()[-1500:]
    if returncode in (-9, 137):
        return {"status": "did not fit", "reason": "killed by SIGKILL (the kernel's out-of-memory killer)"}
    if any(sign in stderr for sign in OUT_OF_MEMORY_SIGNS):
        return {"status": "did not fit", "reason": f"out of memory: {tail.splitlines()[-1] if tail else ''}"}
    return {"status": "error", "reason": f"exit code {returncode}: {tail}"}


def run_point(implementation: str, length: int, *, batch: int, decode_tokens: int, repeats: int, model: str,
              hf_dir: str | None, real_prefill: bool, seed: int, threads: int | None, timeout_s: float | None,
              work_dir: str, retention: dict | None = None) -> dict:
    """Runs one point in a fresh Python process; returns its measurements or why there are none."""
    result_path = os.path.join(work_dir, f".point-{implementation}-{length}.json")
    if os.path.exists(result_path):
        os.remove(result_path)  # left by an earlier, interrupted benchmark
    # Run by file path, not `-m linjax.eval.latency_point`: importing the linjax package would import
    # JAX into the transformers process and add its memory to that baseline's.
    command = [sys.executable, latency_point.__file__, "--one", implementation, "--length", str(length),
               "--batch", str(batch), "--decode-tokens", str(decode_tokens), "--repeats", str(repeats),
               "--model", model, "--seed", str(seed), "--result", result_path]
    command += ["--hf-dir", hf_dir] if hf_dir else []
    command += ["--real-prefill"] if real_prefill else []
    command += ["--threads", str(threads)] if threads else []
    if retention:
        command += ["--retain", str(retention["retain"]), "--retain-score", retention["retain_score"]]
    # On a GPU, JAX would otherwise reserve 75% of it up front; peak_bytes_in_use is exact either way.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TRANSFORMERS_VERBOSITY="error")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"no result after {timeout_s} s"}
    try:
        with open(result_path) as f:
            point = json.load(f)
        os.remove(result_path)
    except FileNotFoundError:
        return dict(failed_point(done.returncode, done.stdout or ""), process_s=time.perf_counter() - start)
    decode_s = statistics.median(point["decode_s_runs"])
    return dict(point, status="ok", decode_s=decode_s, ms_per_token=1000 * decode_s / decode_tokens,
                process_s=time.perf_counter() - start)


# ----------------------------------------------------------------------------- the benchmark


def resolve_hf_dir(model: str, hf_dir: str | None) -> str:
    """The transformers directory of `model`: `hf_dir`, the model itself if it is one, or a default."""
    if hf_dir:
        return hf_dir
    if os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(os.path.join(model, "linjax.json")):
        return model
    if model in DEFAULT_HF_DIRS:
        return DEFAULT_HF_DIRS[model]
    raise ValueError(f"which transformers directory holds {model!r}? pass --hf-dir DIR (it is exported there "
                     "with linjax.save_hf if absent)")


def ensure_hf_dir(model: str, hf_dir: str, progress=print) -> dict:
    """The HF config of `hf_dir`, exporting `model` there first (linjax.save_hf) if it has none."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        progress(f"exporting {model} to {hf_dir} for transformers (linjax.save_hf)")
        loaded, tokenizer = linjax.load(model)
        if loaded.linearize_config is not None:
            raise ValueError(f"{model} is linearized; the benchmark needs the full-attention model it came from")
        linjax.save_hf(loaded, hf_dir, tokenizer)
        del loaded
    with open(config_path) as f:
        return json.load(f)


def machine_info() -> dict:
    """What the timings depend on; versions read from package metadata (nothing imported)."""
    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), "mem_total_bytes": _meminfo_total(),
            **{p: version(p) for p in ("jax", "jaxlib", "flax", "torch", "transformers")}}


def _meminfo_total():
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None


def run(*, implementations=DEFAULT_IMPLEMENTATIONS, lengths=DEFAULT_LENGTHS, batch: int = BATCH,
        decode_tokens: int = DECODE_TOKENS, repeats: int = 3, model: str = DEFAULT_MODEL, hf_dir: str | None = None,
        real_prefill: bool = False, memory_limit_bytes: int | None = None, threads: int | None = None,
        timeout_s: float | None = None, seed: int = 0, out_dir: str, progress=print, retain: int | None = None,
        retain_score: str | None = None) -> dict:
    """The whole benchmark: every implementation at every length, smallest L first; writes
    latency.json after every point, then latency.md and latency.png. Returns the JSON's content.

    A KV-cache point whose cache alone needs more than `memory_limit_bytes` (default: the
    MemAvailable of the moment) is not started; once an implementation has a point that did not
    complete, its longer lengths are skipped.
    """
    implementations, lengths = parse_implementations(implementations), sorted(set(parse_lengths(lengths)))
    retention = retention_settings(implementations, retain, retain_score)
    for name, value in (("batch", batch), ("decode_tokens", decode_tokens), ("repeats", repeats)):
        if int(value) < 1:
            raise ValueError(f"{name} must be ≥ 1, got {value}")
    if threads is not None and not 1 <= threads <= available_cores():
        raise ValueError(f"threads must be between 1 and the {available_cores()} available cores, got {threads}")
    hf_dir = resolve_hf_dir(model, hf_dir)
    hf_config = ensure_hf_dir(model, hf_dir, progress)
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "machine": machine_info(), "model": model, "hf_dir": os.path.abspath(hf_dir),
        "protocol": {"batch": batch, "decode_tokens": decode_tokens, "repeats": repeats, "dtype": "float32",
                     "decoding": "greedy", "threads": threads or available_cores(),
                     "memory_limit_bytes": memory_limit_bytes or "MemAvailable before each point",
                     "timed": f"the {decode_tokens} decode steps end to end, median of {repeats} runs after one "
                              "untimed warm-up run (linjax: compiled before the state exists)",
                     "ms_per_token": "decode_s / decode_tokens in ms: a step makes one token for every sequence",
                     "source": "paper sec. 3.3 and appendix 'Latency and memory' (batch 8, 16 new tokens)"},
        "prefill": "real" if real_prefill else STAND_IN,
        "prefill_note": ("each point runs the real prefill of L random tokens" if real_prefill else
                         "no prefill runs: the decode state has the shapes a prefill of L tokens leaves, random "
                         "values, and its token counters set to L (only the decode steps are timed)"),
        "implementations": {k: implementation_label(k, **(retention or {})) for k in implementations},
        "retention": retention,
        "lengths": lengths, "points": [],
        "cache_bytes_per_layer": cache_table(hf_config, implementations, lengths, decode_tokens, retention),
    }
    stopped = {}  # implementation → why its longer lengths are skipped
    total = len(lengths) * len(implementations)
    for length in lengths:
        for impl in implementations:
            name = result["implementations"][impl]
            label = f"[{len(result['points']) + 1}/{total}] {name} L={length}"
            point = {"impl": impl, "name": name, "L": length, "prefill": result["prefill"]}
            needed = kv_cache_bytes(hf_config, batch, length + decode_tokens) if impl in KV_CACHE_IMPLEMENTATIONS else 0
            available = memory_limit_bytes if memory_limit_bytes is not None else mem_available_bytes()
            if impl in stopped:
                point.update(status="skipped", reason=stopped[impl])
            elif available is not None and needed > available:
                point.update(status="did not fit", state_bytes=needed,
                             reason=f"not started: the KV cache alone needs {needed / GIB:.2f} GiB, "
                                    f"{available / GIB:.2f} GiB available")
            else:
                progress(f"{label}: running")
                point.update(run_point(impl, length, batch=batch, decode_tokens=decode_tokens, repeats=repeats,
                                       model=model, hf_dir=hf_dir, real_prefill=real_prefill, seed=seed,
                                       threads=threads, timeout_s=timeout_s, work_dir=out_dir,
                                       retention=retention if impl == "retained" else None))
            if point["status"] != "ok":
                stopped.setdefault(impl, f"L={length} did not complete ({point['status']})")
            result["points"].append(point)
            result["summary"] = summarize(result)
            write_json(os.path.join(out_dir, "latency.json"), result)
            progress(f"{label}: {describe(point)}")
    write_text(os.path.join(out_dir, "latency.md"), markdown(result))
    plot(result, os.path.join(out_dir, "latency.png"))
    return result


def cache_table(hf_config: dict, implementations, lengths, decode_tokens: int, retention: dict | None) -> dict:
    """{implementation: {L: [bytes of each layer's decode cache]}} for the linjax implementations, for one
    sequence with room for L + decode_tokens tokens: from the cache shapes, so the same on every machine."""
    return {impl: {str(L): cache_bytes_per_layer(hf_config, impl, 1, L + decode_tokens, **(retention or {}))
                   for L in lengths}
            for impl in implementations if impl in LINJAX_IMPLEMENTATIONS}


def describe(point: dict) -> str:
    """One progress line's worth of a point."""
    if point["status"] != "ok":
        return f"{point['status']} ({point.get('reason', '')})"
    return (f"{point['decode_s']:.3f} s for the decode steps ({point['ms_per_token']:.1f} ms per step), "
            f"peak {peak_bytes(point) / GIB:.2f} GiB, state {point['state_bytes'] / 2 ** 20:,.1f} MiB")


# ----------------------------------------------------------------------------- reports


def peak_bytes(point: dict) -> int | None:
    """The peak to report: the device's where there is one, else the process's resident set."""
    return point.get("peak_device_bytes", point.get("peak_rss_bytes"))


def _ok(result, impl):
    return {p["L"]: p for p in result["points"] if p["impl"] == impl and p["status"] == "ok"}


def summarize(result: dict) -> dict:
    """Linearized vs each KV-cache implementation at the largest L both finished, and how flat each
    linear implementation's peak memory is from its smallest to its largest L
    (`linearized_memory_change`, `retained_memory_change`)."""
    summary = {"ratios": []}
    linear = _ok(result, "linearized")
    for other in KV_CACHE_IMPLEMENTATIONS:
        theirs = _ok(result, other)
        both = sorted(set(linear) & set(theirs))
        if both:
            L = both[-1]
            summary["ratios"].append({
                "versus": other, "L": L, "speedup": theirs[L]["decode_s"] / linear[L]["decode_s"],
                "peak_bytes": peak_bytes(theirs[L]), "linearized_peak_bytes": peak_bytes(linear[L])})
    for impl in LINEAR_IMPLEMENTATIONS:
        points = _ok(result, impl)
        if len(points) >= 2:
            low, high = min(points), max(points)
            change = 100 * (peak_bytes(points[high]) - peak_bytes(points[low])) / peak_bytes(points[low])
            summary[f"{impl}_memory_change"] = {"from_L": low, "to_L": high, "percent": change,
                                                "flat_within_10_percent": abs(change) <= 10}
    return summary


def _cell(point, kind):
    if point is None:
        return "–"
    if point["status"] != "ok":
        return point["status"]
    if kind == "time":
        return f"{point['decode_s']:.3f}"
    return f"{peak_bytes(point) / GIB:.2f} / {point['state_bytes'] / GIB:.2f}"


def markdown(result: dict) -> str:
    """latency.md: the protocol, one row per L, and the summary ratios."""
    impls, protocol, machine = list(result["implementations"]), result["protocol"], result["machine"]
    by_key = {(p["impl"], p["L"]): p for p in result["points"]}
    devices = sorted({p["device"] for p in result["points"] if p.get("device")})
    memory = ("the device's peak bytes in use" if any("peak_device_bytes" in p for p in result["points"])
              else "the process's resident-set peak (VmHWM) from just before the state exists")
    steps = protocol["decode_tokens"]
    lines = [f"# Decode latency and peak memory: {result['model']}", "",
             (f"Batch {protocol['batch']}, a prompt of L tokens, then {steps} greedy decode steps timed end to end "
              f"(median of {protocol['repeats']} after a warm-up), float32, {protocol['threads']} thread(s) per point. "
              f"Prefill: **{result['prefill']}** ({result['prefill_note']}). Peak memory: {memory}. "
              f"Machine: {machine['cpu_count']} CPU cores, {', '.join(devices) or 'device not recorded'}; "
              f"jax {machine['jax']}, torch {machine['torch']}, transformers {machine['transformers']}."), ""]
    lines += [f"- `{impl}`: {result['implementations'][impl]}" for impl in impls]
    lines += ["", "Peak: the memory measured; state: the decode state's own size (KV cache or linear state).", ""]
    header = ["L"]
    for impl in impls:
        header += [f"{impl}: {steps} steps (s)", f"{impl}: peak / state (GiB)"]
    speedups = [o for o in KV_CACHE_IMPLEMENTATIONS if "linearized" in impls and o in impls]
    header += [f"speed-up over {o}" for o in speedups]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for L in result["lengths"]:
        row = [f"{L:,}"]
        for impl in impls:
            row += [_cell(by_key.get((impl, L)), "time"), _cell(by_key.get((impl, L)), "memory")]
        for other in speedups:
            theirs, ours = by_key.get((other, L)), by_key.get(("linearized", L))
            finished = theirs and ours and theirs["status"] == ours["status"] == "ok"
            row.append(f"{theirs['decode_s'] / ours['decode_s']:.2f}×" if finished else "–")
        lines.append("| " + " | ".join(row) + " |")
    summary = result.get("summary", {})
    lines.append("")
    for r in summary.get("ratios", []):
        lines.append(f"- At L = {r['L']:,}, the largest both finished: linearized decodes {r['speedup']:.2f}× as fast "
                     f"as `{r['versus']}`, at a peak of {r['linearized_peak_bytes'] / GIB:.2f} GiB against "
                     f"{r['peak_bytes'] / GIB:.2f} GiB.")
    for impl in LINEAR_IMPLEMENTATIONS:
        change = summary.get(f"{impl}_memory_change")
        if change:
            flat = "flat" if change["flat_within_10_percent"] else "not flat"
            lines.append(f"- {impl.capitalize()} peak memory from L = {change['from_L']:,} to {change['to_L']:,}: "
                         f"{change['percent']:+.1f}% ({flat} within 10%).")
    failed = [p for p in result["points"] if p["status"] not in ("ok", "skipped")]
    lines += [f"- `{p['impl']}` at L = {p['L']:,}: {p['status']} ({p.get('reason', '')})." for p in failed]
    lines += cache_lines(result)
    return "\n".join(lines) + "\n"


def _kib(sizes: list[int]) -> str:
    """A layer size in KiB, or the range when layers differ (layers kept as full attention)."""
    low, high = min(sizes) / 1024, max(sizes) / 1024
    return f"{low:,.1f}" if low == high else f"{low:,.1f}–{high:,.1f}"


def cache_lines(result: dict) -> list[str]:
    """latency.md's cache table: bytes per layer by L, from the cache shapes (results without it: none)."""
    table = result.get("cache_bytes_per_layer") or {}
    if not table:
        return []
    impls = list(table)
    new_tokens = result["protocol"]["decode_tokens"]
    lines = ["", f"Decode cache per layer (KiB) for one sequence with room for L + {new_tokens} "
                 "tokens, float32, from the cache shapes (not measured: the same on any machine).", "",
             "| L | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for L in result["lengths"]:
        lines.append(f"| {L:,} | " + " | ".join(_kib(table[impl][str(L)]) for impl in impls) + " |")
    for impl in impls:
        sizes = [sum(table[impl][str(L)]) for L in result["lengths"]]
        if len(sizes) >= 2:
            lines.append(f"- `{impl}`: {'fixed' if len(set(sizes)) == 1 else 'grows'} in L "
                         f"({sizes[0] / 1024:,.1f} KiB at L = {result['lengths'][0]:,}, "
                         f"{sizes[-1] / 1024:,.1f} KiB at L = {result['lengths'][-1]:,}, all layers).")
    return lines


def plot(result: dict, path: str) -> None:
    """latency.png: decode latency and peak memory against L (log2 axis), one line per implementation."""
    plt = pyplot()
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in result["implementations"]:
        points = sorted(_ok(result, impl).values(), key=lambda p: p["L"])
        lengths = [p["L"] for p in points]
        name = result["implementations"][impl]
        time_ax.plot(lengths, [p["decode_s"] for p in points], "o-", label=name)
        memory_ax.plot(lengths, [peak_bytes(p) / GIB for p in points], "o-", label=name)
    decode_tokens = result["protocol"]["decode_tokens"]
    time_ax.set_ylabel(f"{decode_tokens} decode steps (s)")
    memory_ax.set_ylabel("peak memory (GiB)")
    for ax in (time_ax, memory_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["lengths"], [f"{L:,}" for L in result["lengths"]])
        ax.set_xlabel("prompt length L (tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    time_ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}: batch {result['protocol']['batch']}, prefill: {result['prefill']}", fontsize=10)
    write_figure(fig, path)
