"""`linjax eval ...`: one subcommand per evaluation; each writes its results to files.

    linjax eval perplexity MODEL [MODEL ...] --data FILE [--seq-len 1024] [--max-windows N | --whole-file]
        [--out F.json]   (per-window results beside it, in F.windows.json)
    linjax eval approx TEACHER STUDENT --data FILE --num-seqs N --seq-len L --out DIR
    linjax eval diagnostics SOURCE --data FILE [--student S] --num-seqs N --seq-len L --out DIR
    linjax eval ruler MODEL --tasks niah_single_1,multikey,vt,... --lengths 1024,2048 --samples N
        [--budgets 128,512 [--window-only]] --out F.json [--resume | --overwrite]
    linjax eval select-layers [--layers N] --keep 0.2 --by uniform|concentration|residual|nmse [--scores F] --out F.toml
    linjax eval lambada MODEL --data-dir DIR [--limit N] [--batch-size B] --out F.json [--resume | --overwrite]
    linjax eval lm-eval MODEL --tasks piqa,arc_easy [--data-dir DIR] [--limit N] [--num-fewshot N] [--batch-size B]
        [--out DIR] [--resume | --overwrite] [--log-samples] [--trust-remote-code]

MODEL: see `linjax.eval.models.load_model`.
"""

from __future__ import annotations

import json
import os
import time

from linjax.app import watchdog
from linjax.app.arguments import (
    names_list,
    non_negative_int,
    optional_positive_ints,
    positive_float,
    positive_int,
    positive_ints,
)
from linjax.eval import approx, diagnostics, lambada, lm_eval_bridge, ruler, select_layers
from linjax.eval.models import load_model
from linjax.eval.perplexity import summary, text_windows, window_scores
from linjax.files import refuse_overlap, write_json
from linjax.linearize import RETAIN_SCORES

# The arguments of `linjax eval` subcommands that name something they read.
INPUT_ARGUMENTS = ("models", "model", "source", "teacher", "student", "data", "data_dir", "haystack", "scores")


def _refuse_earlier_results(args, results: str | None, resume: bool = False) -> None:
    """An --out holding `results` of an earlier run is replaced only with --overwrite (or continued with
    --resume, where the command has it): one line naming it otherwise, before any work. An --out (or
    its results file) that is one of the command's inputs, links resolved, is refused even so."""
    if getattr(args, "out", None):
        inputs = []
        for name in INPUT_ARGUMENTS:
            value = getattr(args, name, None)
            inputs += [("the input", v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
        for output in {args.out, results} - {None}:
            refuse_overlap(output, inputs, "--out", "another --out", relations=("is",))
    if results and os.path.exists(results) and not (args.overwrite or resume):
        go_on = "--resume goes on with them, " if hasattr(args, "resume") else ""
        raise FileExistsError(f"{os.path.abspath(args.out)} already holds results ({os.path.basename(results)}); "
                              f"{go_on}--overwrite replaces them, or choose another --out")


def _add_overwrite(parser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results --out holds (without it such an --out is refused)")


def windows_path(out: str) -> str:
    """Where `linjax eval perplexity --out F.json` writes its per-window results: F.windows.json."""
    return (out[:-5] if out.endswith(".json") else out) + ".windows.json"


def _perplexity(args):
    _refuse_earlier_results(args, args.out)
    _refuse_earlier_results(args, args.out and windows_path(args.out))
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    rows, per_window = [], []
    for spec in args.models:
        model, tokenizer, description = load_model(spec, args.dtype)
        if tokenizer is None:
            raise ValueError(f"{spec} has no tokenizer; perplexity needs one to read {args.data}")
        windows, articles = text_windows(tokenizer, text, args.seq_len, args.max_windows, args.whole_file)
        start = time.perf_counter()
        scores = window_scores(model, windows, batch_size=args.batch_size, progress=True)
        result = summary(scores)
        result.update(model=description, seconds=time.perf_counter() - start)
        rows.append(result)
        per_window.append({"model": description, "article": articles, **scores})
        print(f"{description}: perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
              f"({result['windows']} windows of {args.seq_len})", flush=True)
        if args.out:  # after every model, so a long comparison loses nothing on a crash
            settings = {"data": os.path.abspath(args.data), "seq_len": args.seq_len, "max_windows": args.max_windows}
            if args.whole_file:
                settings["whole_file"] = True
            write_json(windows_path(args.out), {**settings, "results": per_window})
            write_json(args.out, {**settings, "results": rows})
    print("\n| model | perplexity | tokens |\n|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['perplexity']:.3f} | {r['tokens']} |")


def _approx(args):
    _refuse_earlier_results(args, os.path.join(args.out, "approx.json"))
    result = approx.run(args.teacher, args.student, data=args.data, num_seqs=args.num_seqs, seq_len=args.seq_len,
                        out_dir=args.out)
    print("| layer | MSE | nMSE |\n|---|---|---|")
    for r in result["per_layer"]:
        print(f"| {r['layer']} | {r['mse']:.4g} | {r['nmse']:.4g} |")
    print(f"→ {os.path.join(args.out, 'approx.json')} and {len(result['plots'])} plots")


def _diagnostics(args):
    _refuse_earlier_results(args, os.path.join(args.out, "diagnostics.json"))
    result = diagnostics.run(args.source, data=args.data, num_seqs=args.num_seqs, seq_len=args.seq_len,
                             out_dir=args.out, student=args.student)
    c, r = result["per_token"]["concentration"], result["per_token"]["residual"]
    print(f"key concentration C_t: first token {c[0]:.3f}, token 10 {c[min(9, len(c) - 1)]:.3f}, last {c[-1]:.3f}")
    print(f"projection residual R_t: first token {r[0]:.3f}, token 10 {r[min(9, len(r) - 1)]:.3f}, last {r[-1]:.3f}")
    print(f"→ {os.path.join(args.out, 'diagnostics.json')} and {len(result['plots'])} plots")


def _select_layers(args):
    _refuse_earlier_results(args, args.out)
    layers = select_layers.select(args.layers, args.keep, args.by, args.scores)
    select_layers.write_fragment(layers, args.out, f"linjax eval select-layers --keep {args.keep} --by {args.by}")
    print(f"keep full attention in layers {layers} → {args.out} (use: linjax train CONFIG --include {args.out})")


def _ruler(args):
    _refuse_earlier_results(args, args.out, args.resume)
    result = ruler.run(args.model, tasks=args.tasks, lengths=args.lengths, samples=args.samples,
                       out=args.out, budgets=args.budgets or None, sinks=args.sinks,
                       window_only=args.window_only, haystack=args.haystack,
                       seed=args.seed, retain=args.retain, retain_score=args.retain_score,
                       retain_block=args.retain_block, resume=args.resume)
    print("\n" + result["table_markdown"] + f"\n→ {args.out}")


def _lambada(args):
    _refuse_earlier_results(args, args.out, args.resume)
    texts = lambada.read_texts(args.data_dir, args.limit)
    model, tokenizer, description = load_model(args.model, args.dtype)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; LAMBADA needs one")
    settings = {"model": description, "data": os.path.abspath(os.path.join(args.data_dir, "lambada")),
                "limit": args.limit, "dtype": args.dtype}
    earlier, earlier_seconds = [], 0.0
    if args.resume and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            saved = json.load(f)
        if {key: saved.get(key) for key in settings} != settings:
            raise ValueError(f"{args.out} holds LAMBADA results of other settings "
                             f"({ {key: saved.get(key) for key in settings} }); --overwrite replaces them")
        earlier, earlier_seconds = saved["examples"], saved.get("seconds", 0.0)
    start = time.perf_counter()

    def save(examples):
        complete = len(examples) == len(texts)
        write_json(args.out, {**settings, "complete": complete, **(lambada.summary(examples) if complete else {}),
                              "seconds": earlier_seconds + time.perf_counter() - start, "examples": examples})

    examples = earlier + lambada.score(model, tokenizer, texts, args.batch_size, progress=True, done=len(earlier),
                                       on_batch=lambda new: save(earlier + new))
    save(examples)
    result = lambada.summary(examples)
    print(f"{description}: LAMBADA acc {100 * result['acc']:.1f}% (± {100 * result['acc_stderr']:.1f}), perplexity "
          f"{result['perplexity']:.2f} over {result['scored']} examples → {args.out}")


def _lm_eval(args):
    _refuse_earlier_results(args, args.out and os.path.join(args.out, "lm_eval_results.json"), args.resume)
    out = args.out or lm_eval_bridge.default_out_dir(args.model, resume=args.resume)
    print(f"lm-eval results will be written to {out}", flush=True)  # before the long run, as lm-eval's CLI
    result = lm_eval_bridge.run(args.model, tasks=args.tasks, data_dir=args.data_dir, limit=args.limit,
                                num_fewshot=args.num_fewshot, batch_size=args.batch_size, out_dir=out,
                                share_prefixes=not args.no_shared_prefixes, resume=args.resume,
                                samples=args.log_samples, trust_remote_code=args.trust_remote_code)
    print(result["table_markdown"])
    print(f"→ {os.path.join(out, 'lm_eval_results.json')} and results.md ({result['seconds']:.0f} s)")


def add_eval_parser(sub) -> None:
    """Registers `linjax eval` and its subcommands on the top-level subparsers."""
    parser = sub.add_parser("eval", help="evaluate a model (perplexity, ...)")
    evals = parser.add_subparsers(dest="evaluation", required=True)

    p = evals.add_parser("perplexity", help="perplexity on a text file in non-overlapping windows")
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="smollm2-135m, a checkpoint or run directory, ..., or an experiment TOML "
                        "(its linearized model before training)")
    p.add_argument("--data", required=True, help="a UTF-8 text file, e.g. WikiText-2 test")
    p.add_argument("--seq-len", type=positive_int, default=1024)
    p.add_argument("--max-windows", type=positive_int, default=None, help="score only the first N windows")
    p.add_argument("--whole-file", action="store_true",
                   help="score every token: the full windows and a shorter last window of what is left")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", help="JSON file for the results")
    watchdog.add_argument(p)
    _add_overwrite(p)
    p.set_defaults(func=_perplexity, watched="linjax eval perplexity")

    p = evals.add_parser("approx", help="per-layer and per-token approximation error (MSE, nMSE) of a student")
    p.add_argument("teacher", help="the original model")
    p.add_argument("student", help="a linearization of it (run directory, checkpoint, or experiment TOML)")
    p.add_argument("--data", required=True, help=".json (Alpaca), .jsonl or .txt held-out text")
    p.add_argument("--num-seqs", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--out", required=True, help="output directory (approx.json, PNG plots)")
    watchdog.add_argument(p)
    _add_overwrite(p)
    p.set_defaults(func=_approx, watched="linjax eval approx")

    p = evals.add_parser("diagnostics", help="key concentration C_t and projection residual R_t per token")
    p.add_argument("source", help="the original (full-attention) model")
    p.add_argument("--student", help="a linearization of it: adds nMSE binned by C and by R")
    p.add_argument("--data", required=True)
    p.add_argument("--num-seqs", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--out", required=True, help="output directory (diagnostics.json, PNG plots)")
    watchdog.add_argument(p)
    _add_overwrite(p)
    p.set_defaults(func=_diagnostics, watched="linjax eval diagnostics")

    p = evals.add_parser("ruler", help="RULER's synthetic tasks (S-NIAH 1/2/3, multi-key/value/query, variable "
                                       "tracking, common/frequent words), greedy, string match")
    p.add_argument("model")
    p.add_argument("--tasks", type=names_list, default="niah_single_1,niah_single_2,niah_single_3",
                   help="comma-separated, from: niah_single_1, niah_single_2, niah_single_3 (S-NIAH), multikey, "
                        "multikey_2, multikey_3 (MK), multivalue (MV), multiquery (MQ), vt (VT), cwe (CWE, about "
                        "700 tokens or more), fwe (FWE)")
    p.add_argument("--lengths", type=positive_ints, default="1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--samples", type=positive_int, default=20, help="samples per task and length")
    p.add_argument("--budgets", type=optional_positive_ints, default="",
                   help="cache budgets (sinks + window) for a linearized model, e.g. 128,512")
    p.add_argument("--sinks", type=non_negative_int, default=8, help="sinks within each budget")
    p.add_argument("--window-only", action="store_true",
                   help="MODEL is full attention: evaluate it as sinks + window softmax alone at each budget "
                        "(the baseline with no linear state)")
    p.add_argument("--retain", type=non_negative_int, default=0,
                   help="tokens kept for their content within each budget (sinks + window + retain = budget; "
                        "docs/retention.md)")
    p.add_argument("--retain-block", type=positive_int, default=1,
                   help="with --retain: choose the retained tokens a block of this many at a time (block-aligned "
                        "window; 1, the default: token by token)")
    p.add_argument("--retain-score", choices=list(RETAIN_SCORES), default="recall",
                   help="what a token leaving the window is scored by (default: recall)")
    p.add_argument("--haystack", help="haystack text for niah_single_2/3, multikey, multivalue and multiquery "
                                      "(default: RULER's Paul Graham essays)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", required=True, help="results JSON (a Markdown table goes next to it), written after "
                                                "every sample")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="go on from the samples --out already holds")
    again.add_argument("--overwrite", action="store_true", help="replace the results --out holds")
    watchdog.add_argument(p)
    p.set_defaults(func=_ruler, watched="linjax eval ruler")

    p = evals.add_parser("select-layers", help="layers to keep as full attention, as a config fragment")
    p.add_argument("--layers", type=positive_int, help="number of layers of the model (default: read from --scores)")
    p.add_argument("--keep", type=positive_float, required=True, help="a fraction (0.2) or a count (6)")
    p.add_argument("--by", default="uniform", choices=["uniform", "concentration", "residual", "nmse"],
                   help="evenly spaced, or the hardest layers: lowest concentration, highest residual or nMSE")
    p.add_argument("--scores", help="diagnostics.json (concentration, residual) or approx.json (nmse)")
    p.add_argument("--out", required=True, help="the TOML fragment to write")
    _add_overwrite(p)
    p.set_defaults(func=_select_layers)

    p = evals.add_parser("lambada", help="LAMBADA (OpenAI) last-word accuracy and perplexity, scored in JAX as "
                                          "lm-eval's lambada_openai scores it (no export to PyTorch)")
    p.add_argument("model", metavar="MODEL", help="smollm2-135m, a checkpoint or run directory, or an experiment TOML")
    p.add_argument("--data-dir", required=True, help="the data folder holding lambada/lambada_test.jsonl")
    p.add_argument("--limit", type=positive_int, default=None, help="score only the first N examples (of 5,153)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", required=True, help="JSON file: the summary and each example's result")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="go on from the examples --out already holds")
    again.add_argument("--overwrite", action="store_true", help="replace the results --out holds")
    watchdog.add_argument(p)
    p.set_defaults(func=_lambada, watched="linjax eval lambada")

    p = evals.add_parser("lm-eval", help="downstream tasks (piqa, arc_easy, ..., mmlu) with lm-evaluation-harness")
    p.add_argument("model", metavar="MODEL",
                   help="an exported HF directory, smollm2-135m, a checkpoint or run directory")
    p.add_argument("--tasks", type=names_list, required=True,
                   help="comma-separated: piqa,arc_easy,arc_challenge,hellaswag,winogrande,mmlu,lambada_openai")
    p.add_argument("--data-dir", help="local benchmark files (the data folder's layout); default: lm-eval's hub tasks")
    p.add_argument("--limit", type=positive_float, default=None,
                   help="documents per task (per MMLU subject); <1: a fraction")
    p.add_argument("--num-fewshot", type=non_negative_int, default=None, help="default: 5 for mmlu, 0 for the rest")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="rows per forward pass of lm-eval's HFLM (with --no-shared-prefixes, and for requests longer "
                        "than the model's context)")
    p.add_argument("--out", help="output directory (lm_eval_results.json, results.md); default: MODEL/lm_eval for a "
                                 "model directory, else runs/lm-eval/<model name>, numbered -2, -3, ... when "
                                 "earlier results are there")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="go on from a killed or earlier run with the same settings in --out (without --out: the "
                            "latest default directory): its finished tasks and the requests it had scored are kept")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the results an explicit --out holds (without it such an --out is refused)")
    p.add_argument("--log-samples", action="store_true",
                   help="also write each task's per-example scores to --out/samples_<task>.jsonl")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run MODEL's own Python files (its config's auto_map) even when they are "
                        "not linjax's export code; without this flag only linjax's own modeling files run")
    p.add_argument("--no-shared-prefixes", action="store_true",
                   help="score with lm-eval's HFLM as is (padded batches of whole requests) instead of computing "
                        "each shared context prefix once; the same numbers, slower on CPU "
                        "(see eval/shared_prefix_lm.py)")
    watchdog.add_argument(p)
    p.set_defaults(func=_lm_eval, watched="linjax eval lm-eval")
