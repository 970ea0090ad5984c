"""The `linjax` command.

    linjax convert SOURCE --out DIR [--format hf|linjax|both] [--dtype bfloat16]
    linjax linearize SOURCE --mechanism gdn --window 56 --sinks 8 --adapter shortconv --out DIR
    linjax export SOURCE --out DIR        (an HF directory PyTorch loads; linearized: trust_remote_code)
    linjax generate SOURCE --prompt TEXT [--max-new-tokens N] [--chat]
    linjax train CONFIG.toml [--set section.key=value ...] [--resume]
    linjax eval perplexity|... MODEL ...   (see linjax/eval/cli.py)
    linjax run CONFIG.toml                 (the whole pipeline to report.md; restartable)
    linjax bench latency [--lengths 1024,...,32768] [--out DIR]   (decode latency and memory vs L)

SOURCE is anything `linjax.load` accepts: `smollm2-135m` (the embedded
default), a `.gguf` file, an HF model directory or hub id, or a linjax
checkpoint directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from linjax import watchdog


def _convert(args):
    import linjax
    from linjax.convert.checkpoint import save_checkpoint

    start = time.perf_counter()
    model, tokenizer = linjax.load(args.source, dtype=args.dtype)
    out = os.path.abspath(args.out)
    written = []
    if args.format in ("hf", "both"):
        linjax.save_hf(model, out, tokenizer)
        written.append(f"HF directory (config.json, model.safetensors{', tokenizer' if tokenizer else ''})")
    if args.format in ("linjax", "both"):
        # Next to the HF files when both are asked for: `linjax.load(DIR)` prefers the linjax checkpoint.
        save_checkpoint(model, out, tokenizer)
        written.append("linjax checkpoint (linjax.json, params/)")
    n_params = linjax.parameter_count(model)
    print(f"converted {args.source} ({model.config.architecture}, {n_params / 1e6:.1f}M parameters, "
          f"{model.dtype}) → {out}: {' + '.join(written)} in {time.perf_counter() - start:.1f}s")


def parse_keep(text: str):
    """'0,5,9' → (0, 5, 9); '0.2' → 0.2 (a fraction of the layers); '' → ()."""
    if not text:
        return ()
    if "," not in text and "." in text:
        return float(text)
    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise ValueError(f"--keep-full-attention takes layer indices like '0,5,9' or a fraction like '0.2', "
                         f"got {text!r}") from None


def _linearize(args):
    import linjax
    from linjax.convert.checkpoint import save_checkpoint

    config = linjax.LinearizeConfig(
        mechanism=args.mechanism, window=args.window, sinks=args.sinks, combine=args.combine,
        adapter=None if args.adapter == "none" else args.adapter,
        keep_full_attention=parse_keep(args.keep_full_attention))
    model, tokenizer = linjax.load(args.source, dtype=args.dtype)
    model = linjax.linearize(model, config, seed=args.seed)
    save_checkpoint(model, args.out, tokenizer)
    from linjax.linearize import mixer_names

    names = mixer_names(model)
    print(f"linearized {args.source}: {names.count(args.mechanism)}/{len(names)} layers {args.mechanism}, "
          f"window {config.window}, sinks {config.sinks}, adapter {config.adapter}; "
          f"{linjax.trainable_parameter_count(model) / 1e6:.2f}M new parameters (untrained) → {args.out}")


def _export(args):
    import linjax

    model, tokenizer = linjax.load(args.source)
    out = linjax.save_hf(model, args.out, tokenizer)
    if model.linearize_config is None:
        how = f"{model.config.architecture}: AutoModelForCausalLM.from_pretrained(DIR)"
    else:
        how = ("LinjaxForCausalLM (modeling_linjax.py, no JAX needed): "
               "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")
    print(f"exported {args.source} → {out}: {how}")


def _generate(args):
    import jax.numpy as jnp

    import linjax
    from linjax.generate import generate

    model, tokenizer = linjax.load(args.source, dtype=args.dtype)
    if tokenizer is None:
        sys.exit(f"error: {args.source} has no tokenizer files; save one next to the weights")
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        sys.exit("error: the prompt is empty after tokenization")
    eos = model.config.eos_token_id if args.stop_at_eos else None
    eos = eos[0] if isinstance(eos, tuple) else eos
    print(prompt, end="", flush=True)
    produced = []

    def show(token):
        produced.append(int(token[0]))
        # Decode the whole continuation each time so multi-token characters print correctly.
        text = tokenizer.decode(produced, skip_special_tokens=True)
        previous = tokenizer.decode(produced[:-1], skip_special_tokens=True)
        print(text[len(previous):], end="", flush=True)

    start = time.perf_counter()
    generate(model, jnp.asarray([ids], jnp.int32), args.max_new_tokens, temperature=args.temperature,
             seed=args.seed, eos_token_id=eos, on_token=show)
    elapsed = time.perf_counter() - start
    print(f"\n[{len(produced)} tokens in {elapsed:.1f}s, prompt {len(ids)} tokens]", file=sys.stderr)


def _train(args):
    from linjax import train
    from linjax.train.sharding import maybe_initialize_distributed

    maybe_initialize_distributed()
    config = train.load_experiment(args.config, args.set, args.include)
    train.run(config, resume=args.resume, progress=not args.no_progress)
    print(f"trained → {os.path.abspath(config.run_dir)} (metrics.jsonl; `linjax.load` restores the model)")


def _run(args):
    from linjax import pipeline, train

    config = train.load_experiment(args.config, args.set, args.include)
    report = pipeline.run(config, watchdog_seconds=args.watchdog)
    print(f"report → {report}")


def _bench_latency(args):
    from linjax.eval import latency

    latency.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linjax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a model to an HF directory and/or a linjax checkpoint")
    p.add_argument("source")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["hf", "linjax", "both"], default="both")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_convert)

    p = sub.add_parser("linearize", help="replace attention with a linear mechanism (untrained) and save")
    p.add_argument("source")
    p.add_argument("--mechanism", default="gdn", help="gla | kgla | gdn | gdn_scalar | hedgehog")
    p.add_argument("--window", type=int, default=56)
    p.add_argument("--sinks", type=int, default=8)
    p.add_argument("--combine", default="sum", help="sum (the paper) | mixed (Liger's 0.5/0.5)")
    p.add_argument("--adapter", default="none", help="none | shortconv | lora")
    p.add_argument("--keep-full-attention", default="", help="layer indices '0,5' or a fraction '0.2'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_linearize)

    p = sub.add_parser("export", help="write an HF directory PyTorch loads without JAX (linearized models too)")
    p.add_argument("source", help="anything linjax.load accepts, e.g. a linjax checkpoint or run directory")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_export)

    p = sub.add_parser("train", help="train the new parameters of a linearized model (TOML experiment)")
    p.add_argument("config", help="experiment TOML file (see README, 'Training')")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--include", action="append", default=[], metavar="FRAGMENT.toml",
                   help="merge a config fragment (e.g. from `linjax eval select-layers`) before --set")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    p.add_argument("--no-progress", action="store_true")
    watchdog.add_argument(p)
    p.set_defaults(func=_train, watched="linjax train")

    p = sub.add_parser("run", help="convert → linearize → train → evaluate → report.md, restartable")
    p.add_argument("config", help="experiment TOML file with an optional [eval] section (see README)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--include", action="append", default=[], metavar="FRAGMENT.toml",
                   help="merge a config fragment (e.g. from `linjax eval select-layers`) before --set")
    watchdog.add_argument(p)
    p.set_defaults(func=_run)

    p = sub.add_parser("generate", help="continue a prompt (greedy by default, with a KV cache)")
    p.add_argument("source")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_generate)

    from linjax.eval.cli import add_eval_parser
    from linjax.eval.latency import add_arguments as add_latency_arguments

    add_eval_parser(sub)

    p = sub.add_parser("bench", help="benchmarks that write JSON, a Markdown table and a plot")
    benches = p.add_subparsers(dest="benchmark", required=True)
    p = benches.add_parser("latency", help="decode latency and peak memory against prompt length, full attention "
                                           "vs linearized (the paper's protocol: batch 8, 16 decode steps)")
    add_latency_arguments(p)
    p.set_defaults(func=_bench_latency)
    return parser


def main(argv=None):
    # transformers is used here for tokenizers only; its "PyTorch was not found" notice is noise.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    watched = getattr(args, "watched", None)  # `linjax run` watches each of its stages itself
    try:
        with watchdog.watch(watched, args.watchdog) if watched else contextlib.nullcontext():
            args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
