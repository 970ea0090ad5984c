"""Where an S-NIAH needle sits in the retained slots while the prompt is read (issue 37's misses).

    python results/retention_inspect.py SAMPLE [--force-needle]

SAMPLE is a prompt of the grid's decisive cell (S-NIAH-1 at 2,048 tokens, seed 0: the same 20 prompts
as results/retention/final-recall-128-niah1-2048.json, numbered from 0). The final recipe
(results/runs/gdn-w56-s8-shortconv) reads it at 8 sinks + 56 window + 64 retained by recall, 16 tokens
at a time; after each piece the script records, over the 90 layer x kv-head caches, the share that
holds each of the needle's digit tokens, and at the end the share for every token of the needle
sentence and the greedy answer. Written to results/retention/inspect-<SAMPLE>[-forced].json.

--force-needle is a diagnostic, not a retention policy (it knows where the needle is): every token of
the needle sentence gets a score no other token reaches, so each cache keeps the whole sentence. If the
model then answers, the miss without it was the selection's, not the reading's.
"""

from __future__ import annotations

import argparse
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
RUN = os.path.join(HERE, "runs", "gdn-w56-s8-shortconv")
TASK, LENGTH, PROMPTS, SEED = "niah_single_1", 2048, 20, 0  # as results/retention.py's decisive cell
SINKS, WINDOW, RETAIN = 8, 56, 64
PIECE = 16  # tokens read between two looks at the caches
ANSWER_TOKENS = 12
FORCED = 1e4  # added to the needle's scores with --force-needle: above any recall error


def force_span(first: int, end: int):
    """Make retention.admit keep positions [first, end) in every cache, whatever their scores."""
    admit = retention.admit

    def admit_forcing(cache, candidate, score, position, valid):
        bonus = lambda p: jnp.where((p >= first) & (p < end), FORCED, 0.0)
        cache = cache._replace(score=cache.score + bonus(cache.position))
        return admit(cache, candidate, score + bonus(position), position, valid)

    retention.admit = admit_forcing


def held_share(states, positions) -> dict[int, float]:
    """{position: share of the layer x kv-head caches whose retained slots hold it}."""
    held = {p: [] for p in positions}
    for state in states:
        retained = getattr(getattr(state, "window", None), "retained", None)
        if retained is None:
            continue
        slots = np.asarray(retained.position[0])  # [R, Hkv]
        for head in range(slots.shape[1]):
            kept = set(slots[:, head].tolist())
            for p in positions:
                held[p].append(p in kept)
    return {p: float(np.mean(h)) for p, h in held.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sample", type=int, help=f"prompt number, 0-{PROMPTS - 1}")
    parser.add_argument("--force-needle", action="store_true", help="keep the needle sentence in every cache")
    args = parser.parse_args(argv)
    if not 0 <= args.sample < PROMPTS:
        sys.exit(f"sample must be 0-{PROMPTS - 1} (the decisive cell's prompts), got {args.sample}")
    model, tokenizer, _ = load_model(RUN)
    generator = Generator(tokenizer, None)
    rng = np.random.default_rng([SEED, TASKS.index(TASK), LENGTH])
    sample = [generator.sample(TASK, LENGTH, rng) for _ in range(PROMPTS)][args.sample]
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    at = sample.prompt.index(sample.needle)
    first, end = count(sample.prompt[:at]), count(sample.prompt[:at + len(sample.needle)])
    digits = [p for p in range(first, end) if tokenizer.decode([ids[p]]).strip().isdigit()]
    if args.force_needle:
        force_span(first - 1, end + 1)  # ±1: a token boundary may move where the needle joins the text

    reader = with_budget(model, sinks=SINKS, window=WINDOW, retain=RETAIN)
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
            trace.append({"tokens_read": read, "digits_held": float(np.mean(list(held_share(states, digits).values())))})
    needle_held = held_share(states, range(first, end))
    answer = []
    for _ in range(ANSWER_TOKENS):
        token = int(jnp.argmax(logits[0]))
        answer.append(token)
        logits, states = forward(params, jnp.asarray([[token]], jnp.int32), states)
    prediction = tokenizer.decode(answer, skip_special_tokens=True)
    result = {
        "sample": args.sample, "depth": sample.depth, "answer": sample.answers[0], "prediction": prediction,
        "correct": sample.answers[0] in prediction, "forced": args.force_needle,
        "needle_tokens": [first, end], "digit_tokens": digits,
        "held_at_end": [{"position": p, "token": tokenizer.decode([ids[p]]), "share": round(s, 3)}
                        for p, s in needle_held.items()],
        "digits_held_while_reading": trace,
    }
    out = os.path.join(HERE, "retention", f"inspect-{args.sample}{'-forced' if args.force_needle else ''}.json")
    write_json(out, result)
    peak = max(trace, key=lambda r: r["digits_held"]) if trace else {"digits_held": 0.0, "tokens_read": 0}
    print(f"sample {args.sample} (depth {sample.depth:.2f}): {'correct' if result['correct'] else 'missed'} "
          f"({prediction.strip()!r} for {sample.answers[0]}); digits held: at most {peak['digits_held']:.2f} "
          f"(after {peak['tokens_read']} tokens), {trace[-1]['digits_held']:.2f} at the end -> {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
