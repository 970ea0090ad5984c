"""Compile linjax's GPU programs for an H100 / H200 on any machine, without a GPU, and write what each
would cost there: compile time, memory against the card and JAX's default pool, kernel launches, and
every Pallas kernel's grid, registers, spilled bytes and shared memory (bench/deviceless.py).

    python bench/compile_gpu.py --out results/bench/compile-gpu-DATE              # every program below
    python bench/compile_gpu.py --out DIR --only train/llama-3.1-8b              # programs whose name starts so
    python bench/compile_gpu.py --guard                                           # small shapes; exit 1 on a problem
    python bench/compile_gpu.py --list

Programs (bench/programs.py defines them; bench/gpu_check.py times the same ones on a card):
    kernel/<mech>/<fwd|fwd+bwd>/T<T>-D<D>   each linear kernel (GDN, GDN scalar gate, GLA, kGLA, Hedgehog
                                            in LoLCATs' form) and sinks + window, Pallas, B 4, H 16, bf16
    train/<model>/<recipe|floor>/<B>x<T>    the final recipe's training step as `linjax train` builds it
                                            (Pallas kernels, bf16 frozen weights, whole-layer remat, the
                                            loss in 1,024-position pieces), and the floor (the frozen
                                            model's loss and gradient to its input embeddings); SmolLM2-135M
                                            and Llama-3.1-8B (abstract weights: nothing 16 GB is made)
    ...-fsdp8                               the 8B step sharded over 8 compile-only H100s (mesh_fsdp = 8)

Each program compiles in a process of its own (no compile cache carries over; a crash costs only that
row), one at a time. Rows go to DIR/compile.jsonl as they finish; DIR/compile.md is rewritten after
each. Needs JAX's CUDA plugin in the environment (`pip install ".[gpu-aot]"`, docs/gpu.md).

--guard compiles every kernel forward + backward at T 256 (bf16, D 128; GDN and GLA also in fp32, GDN at
D 64) and the final recipe's step and the floor of a tiny model at 1 × 512, and fails on a compile error, a Pallas
kernel that spills registers, a program over JAX's pool, or a sequence-square tensor
(tests/test_gpu_compile.py runs it on every CI run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# bench/ is not a package, and on sys.path its kernels.py would shadow the PyPI package `kernels`.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Before jax is imported (bench/deviceless.py says why): CUDA's compile-only devices without a driver,
# and XLA's log of its compile phases and of ptxas' registers and spills.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
os.environ["TF_CPP_VMODULE"] = "gpu_compiler=1,nvptx_compiler=1,subprocess_compilation=2"
deviceless = _sibling("deviceless")
programs = _sibling("programs")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# A program read from JAX's persistent cache would not be compiled, and its kernels not measured.
jax.config.update("jax_enable_compilation_cache", False)

KERNEL_SHAPE = dict(B=4, H=16)
# (model, batch, tokens, what, fsdp devices)
TRAIN = [("smollm2-135m", 1, 4096, "recipe", 1), ("smollm2-135m", 4, 4096, "recipe", 1),
         ("smollm2-135m", 1, 16384, "recipe", 1), ("smollm2-135m", 1, 4096, "floor", 1),
         ("smollm2-135m", 4, 4096, "floor", 1), ("smollm2-135m", 1, 16384, "floor", 1),
         ("llama-3.1-8b", 1, 4096, "recipe", 1), ("llama-3.1-8b", 1, 4096, "floor", 1),
         ("llama-3.1-8b", 2, 4096, "recipe", 1), ("llama-3.1-8b", 4, 4096, "recipe", 1),
         ("llama-3.1-8b", 8, 4096, "recipe", 1), ("llama-3.1-8b", 16, 4096, "recipe", 1),
         ("llama-3.1-8b", 32, 4096, "recipe", 1), ("llama-3.1-8b", 1, 8192, "recipe", 1),
         ("llama-3.1-8b", 8, 4096, "recipe", 8)]


def catalogue(guard: bool = False) -> list[dict]:
    """Every program as {name, kind, target, ...its parameters}."""
    found = []
    if guard:  # every mechanism as training runs it (bf16, D 128), the delta rule and GLA in fp32, GDN at D 64
        cases = [(mech, 256, 128, "bfloat16") for mech in programs.KERNELS] + \
            [("gdn", 256, 128, "float32"), ("gla", 256, 128, "float32"), ("gdn", 256, 64, "bfloat16")]
        B, H, parts = 1, 2, ("fwd+bwd",)
    else:
        cases = [(mech, T, D, "bfloat16") for mech in programs.KERNELS for T in (4096, 16384) for D in (128, 64)]
        B, H, parts = KERNEL_SHAPE["B"], KERNEL_SHAPE["H"], ("fwd", "fwd+bwd")
    for mech, T, D, dtype in cases:
        for part in parts:
            found.append(dict(name=f"kernel/{mech}/{part}/T{T}-D{D}" + ("" if dtype == "bfloat16" else "-fp32"),
                              kind="kernel", target="h100", mech=mech, backward=part == "fwd+bwd", B=B, T=T,
                              H=H, D=D, dtype=dtype))
    train = [("tiny", 1, 512, "recipe", 1), ("tiny", 1, 512, "floor", 1)] if guard else TRAIN
    for model, batch, T, what, fsdp in train:
        for target in (("h100",) if guard or fsdp > 1 else ("h100", "h200")):
            name = f"train/{model}/{what}/{batch}x{T}" + (f"-fsdp{fsdp}" if fsdp > 1 else "") + f"@{target}"
            found.append(dict(name=name, kind="train", target=target, model=model, batch=batch, T=T, what=what,
                              fsdp=fsdp))
    return found


def compile_one(program: dict) -> dict:
    """Build and compile one program for its target card, in this process."""
    from linjax.platform import compiling_for

    target = program["target"]
    with compiling_for("cuda"):
        if program["kind"] == "kernel":
            mesh = deviceless.gpu_mesh(target, (1,), ("x",))
            where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            p = program
            args = programs.kernel_inputs(p["mech"], p["B"], p["T"], p["H"], p["D"], jnp.dtype(p["dtype"]),
                                          sharding=where)
            fn = jax.jit(programs.kernel_program(p["mech"], "pallas", p["backward"]))
            record = deviceless.compile_for_gpu(p["name"], fn, tuple(args), target)
        else:
            mesh = deviceless.gpu_mesh(target, (1, program["fsdp"]), ("data", "fsdp"))
            fn, args = programs.train_step_program(program["model"], program["batch"], program["T"],
                                                   program["what"], mesh, abstract=True)
            config = programs.model_config(program["model"])
            widths = {config.hidden_size, config.intermediate_size, config.vocab_size,
                      config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim}
            # A sequence-square tensor is told from the others by its two axes of length T, which is
            # ambiguous where T is one of the model's widths (Llama-3.1-8B's 4,096).
            checked = program["T"] if not widths & {program["T"], program["T"] - 1} else None
            record = deviceless.compile_for_gpu(program["name"], fn, args, target, sequence_length=checked)
            if checked is None:
                record["sequence_squares"] = "not checked: T is one of the model's widths"
    record.update({k: v for k, v in program.items() if k not in record})
    record["problems"] = deviceless.problems(record)
    return record


# ------------------------------------------------------------------------------------------- report

GiB = 2 ** 30


def markdown(rows: list[dict], title: str) -> str:
    s = lambda r, k: f"{r[k]:.1f}" if r.get(k) is not None else "–"  # noqa: E731
    lines = [f"# {title}", "",
             f"Deviceless compiles (JAX {rows[0]['jax'] if rows else '?'}, XLA's GPU compiler on this machine's CPU; "
             "no autotuning). `python bench/compile_gpu.py` (docs/gpu.md). Memory: arguments + outputs − aliased + "
             "temporaries; the pool is JAX's default 75 % of the card.", "",
             "| program | compile s | HLO passes / LLVM / ptxas s | temp GiB | total GiB | fits card / pool | "
             "launches | Pallas kernels: max registers, spilled B, max shared KiB | problems |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['program']} | {s(r, 'compile_s')} | | | | | | | {'; '.join(r['problems'])} |")
            continue
        phases = r.get("phases", {})
        split = " / ".join(f"{phases[k]:.1f}" if k in phases else "–" for k in ("hlo_passes_s", "llvm_to_ptx_s",
                                                                                "ptxas_s"))
        kernels = r.get("pallas_kernels", [])
        own = (f"{max(k.get('registers', 0) for k in kernels)}, {sum(k.get('spill_bytes', 0) for k in kernels)}, "
               f"{max(k['shared_bytes'] for k in kernels) / 1024:.0f}") if kernels else "–"
        fits = f"{'yes' if r['fits']['card'] else 'NO'} / {'yes' if r['fits']['pool'] else 'NO'}"
        lines.append(f"| {r['program']} | {r['compile_s']:.1f} | {split} | {r['temp_bytes'] / GiB:.2f} | "
                     f"{r['total_bytes'] / GiB:.2f} | {fits} | {r['launches']} | {own} | "
                     f"{'; '.join(r['problems']) or '–'} |")
    kernel_rows = [(r["program"], k) for r in rows for k in r.get("pallas_kernels", [])]
    if kernel_rows:
        lines += ["", "## Pallas kernels", "", "| program | kernel | grid | threads | registers | spilled B | "
                  "shared B |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {p} | {k['name']} | {k['grid']} | {k['threads'][0]} | {k.get('registers', '?')} | "
                  f"{k.get('spill_bytes', '?')} | {k['shared_bytes']:,} |" for p, k in kernel_rows]
    return "\n".join(lines) + "\n"


def _in_child(program: dict, limit: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--program", program["name"]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        why = f"not compiled within {limit:.0f} s"
        return dict(program=program["name"], target=program["target"], error=why, problems=[why])
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return dict(program=program["name"], target=program["target"], error=f"exit {done.returncode}: {tail}",
                    problems=[f"does not compile: exit {done.returncode}: {tail}"])


def run_all(args, selected: list[dict], rows: list[dict]) -> list[dict]:
    for program in selected:
        start = time.perf_counter()
        # --guard compiles in this process (a few seconds of imports saved per program); a full run gives
        # each program a fresh process, so no compile time benefits from an earlier program's caches.
        record = compile_one(program) if args.guard else _in_child(program, args.limit)
        record["process_s"] = round(time.perf_counter() - start, 1)
        rows.append(record)
        print(f"{record['program']}: compile {record.get('compile_s', '?')} s, "
              f"{'; '.join(record['problems']) or 'ok'}", flush=True)
        if args.out:
            with open(os.path.join(args.out, "compile.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            with open(os.path.join(args.out, "compile.md"), "w") as f:
                f.write(markdown(rows, "linjax's GPU programs compiled for an H100 / H200 without a GPU"))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for compile.jsonl and compile.md (must not hold a run already)")
    p.add_argument("--only", default="", help="only the programs whose name starts with this")
    p.add_argument("--guard", action="store_true", help="small shapes for CI; exit 1 if any program has a problem")
    p.add_argument("--list", action="store_true", help="print the programs' names and exit")
    p.add_argument("--append", action="store_true", help="add the programs not yet in --out's compile.jsonl to it")
    p.add_argument("--limit", type=float, default=900, help="seconds one program may take (default 900)")
    p.add_argument("--program", help=argparse.SUPPRESS)  # one program, in a child process
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    everything = catalogue(args.guard)
    if args.program:
        program = next((p for p in everything if p["name"] == args.program), None)
        if program is None:
            sys.stderr.write(f"compile_gpu: no program named {args.program!r} (--list shows them)\n")
            return 2
        print(json.dumps(compile_one(program)), flush=True)
        return 0
    selected = [p for p in everything if p["name"].startswith(args.only)]
    if args.list:
        print("\n".join(p["name"] for p in selected))
        return 0
    if not selected:
        sys.stderr.write(f"compile_gpu: no program name starts with {args.only!r} (--list shows them)\n")
        return 2
    if not args.out and not args.guard:
        sys.stderr.write("compile_gpu: --out DIR is needed (or --guard)\n")
        return 2
    done = []
    if args.out:
        existing = os.path.join(args.out, "compile.jsonl")
        if os.path.exists(existing) and not args.append:
            sys.stderr.write(f"compile_gpu: {args.out} already holds a run (compile.jsonl); choose another --out, "
                             "or --append the programs it lacks\n")
            return 2
        if os.path.exists(existing):
            with open(existing) as f:
                done = [json.loads(line) for line in f if line.strip()]
            selected = [p for p in selected if p["name"] not in {r["program"] for r in done}]
        os.makedirs(args.out, exist_ok=True)
    rows = run_all(args, selected, done)[len(done):]
    failed = [r for r in rows if r["problems"]]
    if failed:
        print("\n".join(f"PROBLEM {r['program']}: {'; '.join(r['problems'])}" for r in failed), flush=True)
    return 1 if args.guard and failed else 0


if __name__ == "__main__":
    sys.exit(main())
