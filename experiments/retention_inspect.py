"""Where an S-NIAH needle sits in the retained slots while the prompt is read (the grid's misses).

    python experiments/retention_inspect.py SAMPLE|all [--task niah1] [--length 2048] [--run final|trained]
                                         [--force-needle]

SAMPLE is a prompt of a grid cell (experiments/retention.py: seed 0, the same 20 prompts as the cell's
file, numbered from 0); `all` reads the cell's 20 prompts one after another. The run reads it at 8
sinks + 56 window + 64 retained by recall, 16 tokens at a time: `final`, the final recipe
(results/runs/gdn-w56-s8-shortconv) choosing token by token; `trained`, the final recipe trained with
the slots on (results/runs/gdn-w56-s8-shortconv-retain64), choosing 8 at a time as it was trained.
After each piece the script records, over the 90 layer x kv-head caches, the share that holds the
needle's value tokens (the number, or the UUID in S-NIAH-3), at the end the share for every token of
the needle sentence and the greedy answer, and which tokens the slots hold instead. One prompt is
written to results/retention/inspect-<SAMPLE>[-forced].json for the decisive cell with the final
recipe (S-NIAH-1 at 2,048), else inspect-<run>-<task>-<length>-<SAMPLE>.json; `all` writes one
summary, inspect-<run>-<task>-<length>.json.

--force-needle is a diagnostic, not a retention policy (it knows where the needle is): every token of
the needle sentence gets a score no other token reaches, so each cache keeps the whole sentence. If the
model then answers, the miss without it was the selection's, not the reading's.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax.eval.models import load_model
from linjax.eval.ruler_tasks import TASKS, Generator
from linjax.files import write_json
from linjax.generate import _compiled_forward
from linjax.kernels import retention
from linjax.linearize import with_budget

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")
RUNS = {  # name -> (run directory, retain_block it chooses by)
    "final": (os.path.join(RESULTS, "runs", "gdn-w56-s8-shortconv"), 1),
    "trained": (os.path.join(RESULTS, "runs", "gdn-w56-s8-shortconv-retain64"), 8),
}
CELL_TASKS = {"niah1": "niah_single_1", "niah2": "niah_single_2", "niah3": "niah_single_3"}  # as retention.py
PROMPTS, SEED = 20, 0  # as experiments/retention.py's cells
SINKS, WINDOW, RETAIN = 8, 56, 64
PIECE = 16  # tokens read between two looks at the caches (a multiple of the trained run's block of 8)
ANSWER_TOKENS = 12
FORCED = 1e4  # added to the needle's scores with --force-needle: above any recall error
COMMON = 12  # the most often held tokens listed in a summary


def force_span(first: int, end: int):
    """Make retention.admit and retention.select (one token or a block leaving the window) keep
    positions [first, end) in every cache, whatever their scores."""

    def bonus(position, score):
        position = position.reshape(position.shape + (1,) * (score.ndim - position.ndim))  # [B, C] -> [B, C, 1]
        return jnp.where((position >= first) & (position < end), FORCED, 0.0)

    for name in ("admit", "select"):
        kept = getattr(retention, name)

        def forcing(cache, candidates, score, position, valid, keep=kept):
            cache = cache._replace(score=cache.score + bonus(cache.position, cache.score))
            return keep(cache, candidates, score + bonus(position, score), position, valid)

        setattr(retention, name, forcing)


def retained_slots(states) -> list[np.ndarray]:
    """The positions each layer x kv-head cache holds, one array [R] per cache (−1: empty)."""
    slots = []
    for state in states:
        retained = getattr(getattr(state, "window", None), "retained", None)
        if retained is not None:
            held = np.asarray(retained.position[0])  # [R, Hkv]
            slots += [held[:, head] for head in range(held.shape[1])]
    return slots


def held_share(states, positions) -> dict[int, float]:
    """{position: share of the layer x kv-head caches whose retained slots hold it}."""
    caches = [set(s.tolist()) for s in retained_slots(states)]
    return {p: float(np.mean([p in kept for kept in caches])) for p in positions}


def token_span(tokenizer, prompt: str, text: str, within: int = 0) -> tuple[int, int]:
    """[first, end) token positions of `text`, found in `prompt` from character `within` on: the tokens
    whose characters overlap it (a word's token carries the space before it)."""
    at = prompt.index(text, within)
    offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = [i for i, (start, stop) in enumerate(offsets) if start < at + len(text) and stop > at]
    return inside[0], inside[-1] + 1


def inspect(reader, tokenizer, sample, index: int) -> dict:
    """One prompt read piece by piece: where its needle's value tokens are, then the greedy answer."""
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    first, end = token_span(tokenizer, sample.prompt, sample.needle)
    value_first, value_end = token_span(tokenizer, sample.prompt, sample.answers[0], sample.prompt.index(sample.needle))
    value = [p for p in range(value_first, value_end) if tokenizer.decode([ids[p]]).strip()]
    graphdef, params = nnx.split(reader)
    forward = _compiled_forward(graphdef)
    states = reader.init_states(1, len(ids) + ANSWER_TOKENS)
    trace, logits = [], None
    for start in range(0, len(ids), PIECE):
        piece = ids[start:start + PIECE]
        for chunk in ([piece] if len(piece) == PIECE else [[t] for t in piece]):  # one compiled shape or one token
            logits, states = forward(params, jnp.asarray([chunk], jnp.int32), states)
        read = start + len(piece)
        if read > first:
            trace.append({"tokens_read": read, "value_held": float(np.mean(list(held_share(states, value).values())))})
    needle_held = held_share(states, range(first, end))
    held_tokens = collections.Counter(tokenizer.decode([ids[p]]) for slots in retained_slots(states)
                                      for p in slots.tolist() if p >= 0)
    answer = []
    for _ in range(ANSWER_TOKENS):
        token = int(jnp.argmax(logits[0]))
        answer.append(token)
        logits, states = forward(params, jnp.asarray([[token]], jnp.int32), states)
    prediction = tokenizer.decode(answer, skip_special_tokens=True)
    return {
        "sample": index, "depth": sample.depth, "tokens": len(ids), "answer": sample.answers[0],
        "prediction": prediction, "correct": sample.answers[0].lower() in prediction.lower(),
        "needle_tokens": [first, end], "value_tokens": value,
        "held_at_end": [{"position": p, "token": tokenizer.decode([ids[p]]), "share": round(s, 3)}
                        for p, s in needle_held.items()],
        "value_held_while_reading": trace,
        "held_tokens_at_end": dict(held_tokens.most_common()),
    }


def summary(rows: list[dict]) -> dict:
    """The cell's prompts in a few numbers: how much of each needle's value the caches take and keep."""
    peak = [max((r["value_held"] for r in row["value_held_while_reading"]), default=0.0) for row in rows]
    end = [row["value_held_while_reading"][-1]["value_held"] for row in rows]
    held = collections.Counter()
    for row in rows:
        held.update(row["held_tokens_at_end"])
    total = sum(held.values())
    return {
        "accuracy": float(np.mean([row["correct"] for row in rows])),
        "value_held_peak_mean": float(np.mean(peak)), "value_held_at_end_mean": float(np.mean(end)),
        "most_held_tokens": [{"token": t, "share_of_slots": round(n / total, 4)} for t, n in held.most_common(COMMON)],
        "prompts": [{key: row[key] for key in ("sample", "depth", "answer", "prediction", "correct")}
                    | {"value_held_peak": round(p, 3), "value_held_at_end": round(e, 3)}
                    for row, p, e in zip(rows, peak, end)],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sample", help=f"prompt number, 0-{PROMPTS - 1}, or all")
    parser.add_argument("--task", choices=sorted(CELL_TASKS), default="niah1")
    parser.add_argument("--length", type=int, choices=(1024, 2048, 4096), default=2048)
    parser.add_argument("--run", choices=sorted(RUNS), default="final",
                        help="final: the final recipe, untrained with the slots; trained: trained with them")
    parser.add_argument("--force-needle", action="store_true", help="keep the needle sentence in every cache")
    args = parser.parse_args(argv)
    every = args.sample == "all"
    if every and args.force_needle:
        sys.exit("--force-needle takes one SAMPLE (the forced span is compiled into the model's step)")
    if not every and not (args.sample.isdigit() and int(args.sample) < PROMPTS):
        sys.exit(f"sample must be 0-{PROMPTS - 1} (a cell's prompts) or all, got {args.sample!r}")
    run, block = RUNS[args.run]
    task = CELL_TASKS[args.task]
    model, tokenizer, _ = load_model(run)
    generator = Generator(tokenizer, None)
    rng = np.random.default_rng([SEED, TASKS.index(task), args.length])
    samples = [generator.sample(task, args.length, rng) for _ in range(PROMPTS)]
    reader = with_budget(model, sinks=SINKS, window=WINDOW, retain=RETAIN, retain_block=block)
    chosen = range(PROMPTS) if every else [int(args.sample)]
    # The decisive cell's single prompts keep their first name (docs/retention.md cites them).
    decisive = (args.run, args.task, args.length) == ("final", "niah1", 2048) and not every
    cell = f"{args.run}-{args.task}-{args.length}"
    forced = "-forced" if args.force_needle else ""
    name = f"inspect-{cell}" if every else f"inspect-{args.sample}" if decisive else f"inspect-{cell}-{args.sample}"
    out = os.path.join(RESULTS, "retention", f"{name}{forced}.json")
    rows = []
    for index in chosen:
        if args.force_needle:
            first, end = token_span(tokenizer, samples[index].prompt, samples[index].needle)
            force_span(first - 1, end + 1)  # ±1: a token boundary may move where the needle joins the text
        row = dict(inspect(reader, tokenizer, samples[index], index), forced=args.force_needle)
        rows.append(row)
        print(f"sample {index} (depth {row['depth']:.2f}): {'correct' if row['correct'] else 'missed'} "
              f"({row['prediction'].strip()!r} for {row['answer']}); value held: at most "
              f"{max((r['value_held'] for r in row['value_held_while_reading']), default=0.0):.2f}, "
              f"{row['value_held_while_reading'][-1]['value_held']:.2f} at the end", flush=True)
    if every:
        write_json(out, {"run": os.path.relpath(run, os.path.dirname(HERE)), "task": task, "length": args.length,
                         "forced": args.force_needle, **summary(rows)})
    else:
        write_json(out, rows[0])
    print(f"-> {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
