"""The `linjax` command.

    linjax convert SOURCE --out DIR [--format hf|linjax|both] [--dtype bfloat16]
    linjax linearize SOURCE --mechanism gdn --window 56 --sinks 8 --adapter shortconv --out DIR
    linjax export SOURCE --out DIR        (an HF directory PyTorch loads; linearized: trust_remote_code)
    linjax generate SOURCE --prompt TEXT [--max-new-tokens N] [--chat]
    linjax train CONFIG.toml [--set section.key=value ...] [--resume]
    linjax eval perplexity|... MODEL ...   (see linjax/app/eval_cli.py)
    linjax run CONFIG.toml                 (the whole pipeline to report.md; restartable)
    linjax bench latency [--lengths 1024,...,32768] [--out DIR]   (decode latency and memory vs L)

SOURCE is anything `linjax.load` accepts: `smollm2-135m` (the embedded
default), a `.gguf` file, an HF model directory or hub id, or a linjax
checkpoint directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
import typing

import jax.numpy as jnp

import linjax
from linjax import fingerprint, storage, train
from linjax.app import compilation_cache, hugepages, latency_cli, pipeline, watchdog
from linjax.app.arguments import non_negative_float, non_negative_int
from linjax.app.eval_cli import add_eval_parser
from linjax.convert.checkpoint import save_checkpoint, write_checkpoint_files
from linjax.files import WriterBusy, check_export_directory, write_directory, writer_lock
from linjax.generate import generate, refuse_what_cannot_fit
from linjax.linearize import (
    ADAPTERS,
    COMBINES,
    CONV_INITS,
    FLA_DEFAULT_SCALE,
    GATES,
    KERNELS,
    MIXERS,
    LinearizeConfig,
    mixer_names,
)
from linjax.train.sharding import maybe_initialize_distributed

# Exit status of every error linjax reports as one line (argparse uses it for its own); a traceback means a bug.
USER_ERROR = 2


def describe_error(err: BaseException) -> str:
    """An exception as the one line linjax prints."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return str(err)


def _convert(args):
    start = time.perf_counter()
    out = check_export_directory(args.out, source=args.source)  # before the slow load
    with writer_lock(out):  # from before the load: a second writer stops at once, not after it
        _convert_locked(args, out, start)


def _convert_locked(args, out, start):
    model, tokenizer = linjax.load(args.source, dtype=args.dtype)
    written = []

    def fill(staging):  # both formats go into one directory, swapped in whole
        if args.format in ("hf", "both"):
            # save_hf picks the writer (plain or linearized) and writes a complete directory; its files move up.
            hf_dir = linjax.save_hf(model, os.path.join(staging, "hf"), tokenizer)
            for name in os.listdir(hf_dir):
                os.replace(os.path.join(hf_dir, name), os.path.join(staging, name))
            os.rmdir(hf_dir)
            written.append(f"HF directory (config.json, model.safetensors{', tokenizer' if tokenizer else ''})")
        if args.format in ("linjax", "both"):
            # Next to the HF files when both are asked for: `linjax.load(DIR)` prefers the linjax checkpoint.
            write_checkpoint_files(model, staging, tokenizer)
            written.append("linjax checkpoint (linjax.json, params/)")

    write_directory(out, fill)
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


# The names each text setting of LinearizeConfig accepts, for --help (LinearizeConfig checks the values).
LINEARIZE_NAMES = {"mechanism": tuple(MIXERS), "combine": COMBINES, "kernel": KERNELS, "gate": GATES,
                   "adapter": tuple("none" if a is None else a for a in ADAPTERS), "conv_init": CONV_INITS,
                   "scale": ("a number > 0", FLA_DEFAULT_SCALE)}


def number_or_name(text: str):
    """A flag that takes a number or a name (`--scale 1` or `--scale fla_default`)."""
    try:
        return float(text)
    except ValueError:
        return text


FLAG_TYPES = {int: non_negative_int, float: float, str: str}


def add_linearize_flags(parser) -> None:
    """One flag per LinearizeConfig field (gate_rank: --gate-rank), with the field's type and default.
    LinearizeConfig checks the values, so a bad one is one line of error."""
    hints = typing.get_type_hints(LinearizeConfig)
    for field in dataclasses.fields(LinearizeConfig):
        flag, hint = "--" + field.name.replace("_", "-"), hints[field.name]
        names = LINEARIZE_NAMES.get(field.name)
        described = (" | ".join(names) + "; " if names else "") + "default: %(default)s"
        if field.name == "keep_full_attention":  # indices or a fraction, read by parse_keep
            parser.add_argument(flag, default="", help="layer indices '0,5' or a fraction '0.2'")
        elif hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=described)
        else:
            kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))  # `X | None`: X
            kind = number_or_name if field.name == "scale" else FLAG_TYPES[kind]
            parser.add_argument(flag, type=kind, default=field.default, help=described)


def _linearize(args):
    settings = {field.name: getattr(args, field.name) for field in dataclasses.fields(LinearizeConfig)}
    config = LinearizeConfig(**{**settings, "keep_full_attention": parse_keep(args.keep_full_attention)})
    check_export_directory(args.out, source=args.source)  # before the slow load
    with writer_lock(args.out):
        model, tokenizer = linjax.load(args.source, dtype=args.dtype)
        model = linjax.linearize(model, config, seed=args.seed)
        save_checkpoint(model, args.out, tokenizer)
    names = mixer_names(model)
    print(f"linearized {args.source}: {names.count(args.mechanism)}/{len(names)} layers {args.mechanism}, "
          f"window {config.window}, sinks {config.sinks}, adapter {config.adapter}; "
          f"{linjax.trainable_parameter_count(model) / 1e6:.2f}M new parameters (untrained) → {args.out}")


def _export(args):
    check_export_directory(args.out, source=args.source)  # before the slow load
    with writer_lock(args.out):
        model, tokenizer = linjax.load(args.source)
        out = linjax.save_hf(model, args.out, tokenizer)
    if model.linearize_config is None:
        how = f"{model.config.architecture}: AutoModelForCausalLM.from_pretrained(DIR)"
    else:
        how = ("LinjaxForCausalLM (modeling_linjax.py, no JAX needed): "
               "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")
    print(f"exported {args.source} → {out}: {how}")


def _generate(args):
    model, tokenizer = linjax.load(args.source, dtype=args.dtype)
    if tokenizer is None:
        raise ValueError(f"{args.source} has no tokenizer files; save one next to the weights")
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty after tokenization; give a longer --prompt")
    eos = model.config.eos_token_id if args.stop_at_eos else None
    eos = eos[0] if isinstance(eos, tuple) else eos
    if args.max_new_tokens:  # before the prompt is echoed: a length that cannot fit is one line, nothing else
        refuse_what_cannot_fit(model, 1, len(ids) + args.max_new_tokens, args.max_new_tokens)
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


def _reraised_by_orbax(record) -> bool:
    """Drops orbax's log of a failed background save thread (with its traceback): orbax raises the same
    error again in the thread that saves, and `linjax train` reports that one as one line."""
    return "_SignalingThread.run() raised an exception" not in record.getMessage()


def _train(args):
    maybe_initialize_distributed()
    config = train.load_experiment(args.config, args.set, args.include)
    absl_logger = logging.getLogger("absl")
    if _reraised_by_orbax not in absl_logger.filters:
        absl_logger.addFilter(_reraised_by_orbax)
    try:
        train.run(config, resume=args.resume, progress=not args.no_progress,
                  allow_changed_inputs=args.allow_changed_inputs, load_finished=False)
    except Exception as err:
        if isinstance(err, (FileNotFoundError, FileExistsError, WriterBusy)):
            raise
        fault = storage.os_error(err)  # tensorstore reports a full disk as a ValueError, orbax as an Exception
        if fault is None:
            raise
        err = fault
        # The other writes of the failed save are still running: let them end before the interpreter
        # shuts down under them (which prints their tracebacks).
        deadline = time.monotonic() + 60
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        # A full disk or an unwritable folder, most likely while saving: orbax commits a checkpoint by a
        # final rename, so every checkpoint listed before the failure is whole.
        raise OSError(err.errno, f"training stopped: {describe_error(err)}. The checkpoints completed in "
                                 f"{os.path.abspath(config.run_dir)} are intact: free some space (or fix the "
                                 "folder's permissions) and continue with --resume") from err
    print(f"trained → {os.path.abspath(config.run_dir)} (metrics.jsonl; `linjax.load` restores the model)")


def _run(args):
    config = train.load_experiment(args.config, args.set, args.include)
    report = pipeline.run(config, watchdog_seconds=args.watchdog, allow_changed_inputs=args.allow_changed_inputs)
    print(f"report → {report}")


def _bench_latency(args):
    latency_cli.main(args)


class _PrintVersion(argparse.Action):
    """`linjax --version`: the version and the folder it runs from, unwrapped (a checkout can sit
    beside an installed package, and which one runs matters)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and where linjax runs from")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"linjax {linjax.__version__} from {os.path.dirname(linjax.__file__)}")
        parser.exit()


def add_experiment_overrides(parser) -> None:
    """--set and --include: how `train` and `run` change an experiment file's settings."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a setting, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--include", action="append", default=[], metavar="FRAGMENT.toml",
                        help="merge a config fragment (e.g. from `linjax eval select-layers`) before --set")


def add_allow_changed_inputs(parser) -> None:
    parser.add_argument("--allow-changed-inputs", action="store_true",
                        help="go on although the base model, tokenizer or training data differ from what the run "
                             f"recorded (any command: {fingerprint.ALLOW_ENV}=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linjax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_PrintVersion)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a model to an HF directory and/or a linjax checkpoint")
    p.add_argument("source")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["hf", "linjax", "both"], default="both")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_convert)

    p = sub.add_parser("linearize", help="replace attention with a linear mechanism (untrained) and save",
                       description="Each setting is a field of linjax.LinearizeConfig, which documents it.")
    p.add_argument("source")
    add_linearize_flags(p)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_linearize)

    p = sub.add_parser("export", help="write an HF directory PyTorch loads without JAX (linearized models too)")
    p.add_argument("source", help="anything linjax.load accepts, e.g. a linjax checkpoint or run directory")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_export)

    p = sub.add_parser("train", help="train the new parameters of a linearized model (TOML experiment)")
    p.add_argument("config", help="experiment TOML file (see README, 'Configuration')")
    add_experiment_overrides(p)
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint "
                   "(a finished run: nothing to do, or extend it to a larger train.steps)")
    add_allow_changed_inputs(p)
    p.add_argument("--no-progress", action="store_true")
    watchdog.add_argument(p)
    p.set_defaults(func=_train, watched="linjax train")

    p = sub.add_parser("run", help="convert → linearize → train → evaluate → report.md, restartable")
    p.add_argument("config", help="experiment TOML file with an optional [eval] section (see README)")
    add_experiment_overrides(p)
    add_allow_changed_inputs(p)
    watchdog.add_argument(p)
    p.set_defaults(func=_run)

    p = sub.add_parser("generate", help="continue a prompt (greedy by default, with a KV cache)")
    p.add_argument("source")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=non_negative_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_generate)

    add_eval_parser(sub)

    p = sub.add_parser("bench", help="benchmarks that write JSON, a Markdown table and a plot")
    benches = p.add_subparsers(dest="benchmark", required=True)
    p = benches.add_parser("latency", help="decode latency and peak memory against prompt length, full attention "
                                           "vs linearized (the paper's protocol: batch 8, 16 decode steps)")
    latency_cli.add_arguments(p)
    p.set_defaults(func=_bench_latency)
    return parser


def main(argv=None):
    try:
        if argv is None:  # the `linjax` command: start again with huge pages for XLA's buffers
            hugepages.reexec_module_with_huge_pages("linjax.app.cli", sys.argv[1:])
            compilation_cache.enable()  # each call is a new process: reuse the programs earlier calls compiled
        # transformers is used here for tokenizers only; its "PyTorch was not found" notice is noise.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        storage.quiet_async_storage_errors()  # a full disk is reported once, below, not by every write task
        watchdog.dump_stacks_on_sigusr1()
        args = build_parser().parse_args(argv)
        watched = getattr(args, "watched", None)  # `linjax run` watches each of its stages itself
        with watchdog.watch(watched, args.watchdog) if watched else contextlib.nullcontext():
            args.func(args)
    except train.Stopped as stopped:  # SIGTERM / SIGINT in training: a checkpoint at the step boundary, then out
        print(f"linjax: {stopped}", file=sys.stderr)
        sys.exit(128 + stopped.signum)  # the shell's status for "ended by this signal": the run is not done
    except Exception as err:  # bad input, a missing file, a full disk: one line, no traceback
        fault = storage.os_error(err)  # however the library reported it (tensorstore: a ValueError)
        if fault is None and not isinstance(err, ValueError):
            raise  # a bug: its traceback
        print(f"linjax: error: {describe_error(fault or err)}", file=sys.stderr)
        sys.exit(USER_ERROR)


if __name__ == "__main__":
    main()
