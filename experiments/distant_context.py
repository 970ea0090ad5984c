"""Does the linear state remember the distant text? Issue 38's loss by position and distant-context swap.

    python experiments/distant_context.py run [--stride N]   # score the swap's windows, resumable
    python experiments/distant_context.py report             # results/distant-context.md

Loss by position: the claims rows' whole-file WikiText-2 scores (`experiments/claims.py evaluate-paired`)
keep the NLL summed per position; the report gives it in bands of position, inside the 64-token
cache (every earlier token is in it) and beyond it, for every row scored.

The distant-context swap: take every STRIDE-th full window of 1,024 tokens of WikiText-2's test file
and replace its tokens 8 .. 903 (all but the 8 sinks and the last 120 tokens) by the tokens at the same
positions of a window starting in another article, half the file away. The last 64 tokens (960 ..
1,023) are scored with the text as it is and as swapped: each of their predictions has only unswapped
tokens in its own layer's 64-token cache (sinks 0-7 and the 56 tokens before). A window-only model
still reads the swapped text through depth (a layer's window holds the previous layer's outputs, which
saw 56 tokens further back: 30 layers reach 1,680 tokens), so the swap is scored for window-only, the
final recipe and the original model (full attention: it reads all the swapped text, the scale of what
the distant text is worth), and the state's part is a difference of differences: the share of the final
recipe's gain over window-only that survives the swap,

    kept = (L_window,swapped − L_final,swapped) / (L_window − L_final),

with a 95% interval from resampling articles (`experiments/stats.py`'s resamples: every reading draws the
same articles). What is not kept came from the distant text through the linear state.

Readings take turns window by window and are saved after every window (results/distant-context/
<reading>.json), so a stopped run goes on from where it was.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run as a script or loaded by path: the `experiments` package
from experiments import claims_data as claims  # noqa: E402  (rows, WikiText-2 settings, per-window files)
from experiments import stats  # noqa: E402

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "results")
CELLS = os.path.join(RESULTS, "distant-context")
REPORT = os.path.join(RESULTS, "distant-context.md")
SINKS, SCORED, KEPT_TAIL = 8, 64, 120  # the sinks, the tokens scored, the tail left as it is (56 + 64)
STRIDE = 8  # every 8th full window: 37 windows, each in another article or nearly
FINAL = "gdn-w56-s8-shortconv"  # the final recipe, seed 1
# reading -> (claims row, swapped?)
READINGS = {"window-only": ("window-w56-s8", False), "window-only-swapped": ("window-w56-s8", True),
            "final": (FINAL, False), "final-swapped": (FINAL, True),
            "original": ("original", False), "original-swapped": ("original", True)}
BANDS = ((1, 63), (64, 127), (128, 255), (256, 511), (512, 1023))  # predicted token positions


def chosen_windows(windows, articles, stride: int = STRIDE):
    """[(index, donor index)]: every `stride`-th full window and a window half the file on that starts in
    another article (the next such one, wrapping around)."""
    length = len(windows[0])
    full = [i for i, w in enumerate(windows) if len(w) == length]
    pairs = []
    for n in range(0, len(full), stride):
        i = full[n]
        for step in range(len(full)):
            donor = full[(n + len(full) // 2 + step) % len(full)]
            if articles[donor] != articles[i]:
                pairs.append((i, donor))
                break
    return pairs


def swapped(window, donor, sinks: int = SINKS, kept_tail: int = KEPT_TAIL):
    """`window` with its tokens sinks .. len - kept_tail taken from `donor` (same positions)."""
    out = np.array(window, copy=True)
    out[sinks:len(out) - kept_tail] = donor[sinks:len(out) - kept_tail]
    return out


def tail_nll(token_nll, scored: int = SCORED):
    """token_nll restricted to the predictions of the last `scored` tokens."""
    return lambda tokens: token_nll(tokens)[:, -scored:]


def cell_path(reading: str) -> str:
    return os.path.join(CELLS, f"{reading}.json")


def read_cell(reading: str):
    return claims.load_json(cell_path(reading))


def run(stride: int = STRIDE) -> None:
    from linjax.eval.models import load_model
    from linjax.eval.perplexity import score_in_turn, text_windows, token_nll_function
    from linjax.files import write_json

    with open(claims.WIKITEXT, encoding="utf-8") as f:
        text = f.read()
    models, readings, about = {}, {}, {}
    for reading, (row, swap) in READINGS.items():
        if row not in models:
            model, tokenizer, _ = load_model(claims.model_argument(row))
            windows, articles = text_windows(tokenizer, text, claims.SEQ_LEN, whole_file=True)
            models[row] = (tail_nll(token_nll_function(model)), windows, articles)
        nll, windows, articles = models[row]
        pairs = chosen_windows(windows, articles, stride)
        texts = [swapped(windows[i], windows[d]) if swap else windows[i] for i, d in pairs]
        earlier = read_cell(reading) or {"window": [], "nll": [], "tokens": []}
        n = len(earlier["nll"])
        if earlier["window"] != [i for i, _ in pairs[:n]]:
            sys.exit(f"{os.path.relpath(cell_path(reading), ROOT)} holds other windows; move it away to score again")
        scores = {key: earlier.get(key, []) for key in ("nll", "tokens", "position_nll", "position_tokens")}
        readings[reading] = (nll, texts, scores)
        about[reading] = dict(row=row, swap=swap, pairs=pairs, articles=[articles[i] for i, _ in pairs])

    def save(reading, scores, index, seconds):
        a = about[reading]
        write_json(cell_path(reading), {
            "row": a["row"], "swapped": a["swap"], "seq_len": claims.SEQ_LEN, "sinks": SINKS, "scored": SCORED,
            "kept_tail": KEPT_TAIL, "stride": stride, "complete": index + 1 == len(a["pairs"]),
            "window": [i for i, _ in a["pairs"][:index + 1]], "donor": [d for _, d in a["pairs"][:index + 1]],
            "article": a["articles"][:index + 1], **scores})

    score_in_turn(readings, save, progress=True)


def position_lines() -> list[str]:
    """NLL per token by band of position, from the claims rows' whole-file per-position sums."""
    lines = ["## Loss by position", "",
             "WikiText-2's whole test file (`experiments/claims.py evaluate-paired`, every row on the same windows "
             "where both are complete; a partial row on its first windows): NLL per token of the tokens predicted "
             "at these positions of a 1,024-token window. Up to position 63 every earlier token is in the 64-token "
             "cache; beyond it, only the linear state holds what left the window.", ""]
    rows = {row: claims.per_window(row) for row in claims.ROWS}
    rows = {row: scores for row, scores in rows.items() if scores and scores.get("position_nll")}
    if not rows:
        return lines + ["No row scored yet."]
    lines += ["| row | windows | " + " | ".join(f"tokens {a}-{b}" for a, b in BANDS) + " |",
              "|---|---|" + "---|" * len(BANDS)]
    for row, scores in rows.items():
        nll, counts = np.asarray(scores["position_nll"]), np.asarray(scores["position_tokens"])
        # position p predicts token p + 1
        bands = [nll[a - 1:b].sum() / counts[a - 1:b].sum() for a, b in BANDS]
        lines.append(f"| {row} | {len(scores['nll'])} | " + " | ".join(f"{x:.3f}" for x in bands) + " |")
    return lines


def swap_lines() -> list[str]:
    cells = {reading: read_cell(reading) for reading in READINGS}
    stride = next((c["stride"] for c in cells.values() if c), STRIDE)
    lines = ["## The distant-context swap", "",
             f"Every {stride}th full window; tokens {SINKS}-{claims.SEQ_LEN - KEPT_TAIL - 1} replaced by another "
             f"article's, the last {SCORED} tokens scored (see this file's script for the design). Δ: log-perplexity "
             "of the first minus the second on the windows both have, 95% paired bootstrap interval over articles.", ""]
    if not all(cells.values()):
        missing = ", ".join(r for r, c in cells.items() if not c)
        return lines + [f"Not run yet: {missing} (`python experiments/distant_context.py run`)."]
    cut = dict(zip(cells, claims.common_windows(*cells.values())))
    n, articles = len(cut["final"]["nll"]), len(set(cut["final"]["article"]))
    lines += [f"{n} windows in {articles} articles" + ("" if all(c["complete"] for c in cells.values())
                                                     else " (partial: the run goes on)") + ".", "",
              "| reading | perplexity of the scored tokens |", "|---|---|"]
    for reading, scores in cut.items():
        lines.append(f"| {reading} | {math.exp(sum(scores['nll']) / sum(scores['tokens'])):.2f} |")

    def delta(a, b):
        return stats.fmt_interval(stats.paired_bootstrap(cut[a], cut[b]))

    (w, ws, f, fs), samples = stats.resampled_log_ppl([cut[r] for r in ("window-only", "window-only-swapped",
                                                                       "final", "final-swapped")])
    kept = (samples[1] - samples[3]) / (samples[0] - samples[2])
    low, high = np.percentile(kept, [2.5, 97.5])
    lines += ["", f"- the final recipe against window-only, text as is: {delta('final', 'window-only')}",
              f"- the same, swapped: {delta('final-swapped', 'window-only-swapped')}",
              f"- window-only, swapped against as is: {delta('window-only-swapped', 'window-only')}",
              f"- the final recipe, swapped against as is: {delta('final-swapped', 'final')}",
              f"- the original model, swapped against as is: {delta('original-swapped', 'original')}",
              f"- **share of the final recipe's gain over window-only kept after the swap: "
              f"{100 * (ws - fs) / (w - f):.0f}% [{100 * low:.0f}%, {100 * high:.0f}%]**; the rest came from the "
              "distant text through the linear state"]
    return lines


def report() -> None:
    from linjax.files import write_text

    lines = ["# Does the linear state remember the distant text?", "",
             "Made by `python experiments/distant_context.py report`. The final recipe is "
             f"`results/runs/{FINAL}` (seed 1); window-only is sinks 8 + window 56 softmax with no state, "
             "untrained; the original is SmolLM2-135M with full attention.", "",
             *position_lines(), "", *swap_lines()]
    path = write_text(REPORT, "\n".join(lines) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="score the swap's windows with every reading, resumable")
    runner.add_argument("--stride", type=int, default=STRIDE, help=f"every Nth full window (default {STRIDE})")
    sub.add_parser("report", help="write results/distant-context.md")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.stride < 1:
            parser.error(f"--stride must be at least 1, got {args.stride}")
        run(args.stride)
    else:
        report()


if __name__ == "__main__":
    main()
