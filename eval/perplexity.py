"""Perplexity on held-out text: the whole file tokenised once, scored in non-overlapping windows.

Each window of `seq_len` tokens is scored on its own (a fresh state or cache), as
lm-eval's rolling perplexity does without overlap; the first token of each
window has no context and is not scored.

Besides the total, every window's NLL sum and scored-token count are kept with the
index of the article it starts in, so an interval can be computed by resampling
articles (results/claims.py), and the NLL summed per position, so loss by position
can be read. Articles are delimited by WikiText's top-level headings (" = Title = ").
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from linjax import heartbeat

# A top-level WikiText heading: " = Title = " alone on a line (sections are " = = Section = = ").
# In WikiText-2's test file two formula fragments inside "Constant k filter" match it too, so
# that article counts as three: 62 headings for 60 articles.
ARTICLE_HEADING = re.compile(r"^ = [^=].* = \r?$", re.MULTILINE)


def article_starts(text: str) -> list[int]:
    """Character offsets at which an article begins: 0, then every top-level heading after it."""
    starts = [m.start() for m in ARTICLE_HEADING.finditer(text)]
    return starts if starts and starts[0] == 0 else [0] + starts


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    return _full_windows(tokenizer(text, add_special_tokens=False)["input_ids"], seq_len, max_windows)


def _full_windows(ids: list[int], seq_len: int, max_windows: int | None) -> np.ndarray:
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        count = min(count, max_windows)
    return np.asarray(ids[:count * seq_len], np.int32).reshape(count, seq_len)


def text_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None,
                 whole_file: bool = False) -> tuple[list[np.ndarray], list[int]]:
    """(windows, the article each starts in). The full windows are token_windows'; with `whole_file`
    the tokens left after the last full window form one shorter last window, so every token of the
    text is in exactly one window (a single token left over has nothing to be scored against and is
    dropped)."""
    if whole_file and max_windows is not None:
        raise ValueError("--whole-file scores every window; drop --max-windows")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    full = _full_windows(ids, seq_len, max_windows)
    windows = list(full)
    if whole_file and len(ids) - len(full) * seq_len >= 2:
        windows.append(np.asarray(ids[len(full) * seq_len:], np.int32))
    starts = article_starts(text)
    articles = [bisect.bisect_right(starts, offsets[i * seq_len][0]) - 1 for i in range(len(windows))]
    return windows, articles


def token_nll_function(model):
    """tokens [B, L] -> the NLL of tokens 1..L-1 [B, L-1] (float64 numpy), compiled once per window shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def token_nll(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]

    return lambda tokens: np.asarray(token_nll(state, jnp.asarray(tokens)), np.float64)


def window_scores(model, windows, batch_size: int = 1, progress: bool = False, token_nll=None) -> dict:
    """Per-window NLL sums and scored-token counts, and the NLL summed over windows per position
    (position p: the token at p + 1 predicted from the p + 1 before it), of `model` over `windows`
    (an [N, L] array or a list of 1-D token arrays; consecutive windows of one length are batched).
    `token_nll`: token_nll_function(model), to reuse its compilation across calls."""
    token_nll = token_nll or token_nll_function(model)
    longest = max(len(w) for w in windows)
    nll, tokens = [], []
    position_nll, position_tokens = np.zeros(longest - 1), np.zeros(longest - 1, np.int64)
    start = 0
    with tqdm(total=len(windows), desc="perplexity", disable=not progress) as bar:
        while start < len(windows):
            stop = start + 1
            while stop < min(start + batch_size, len(windows)) and len(windows[stop]) == len(windows[start]):
                stop += 1
            per_token = token_nll(np.stack(windows[start:stop]))
            nll += per_token.sum(axis=1).tolist()
            tokens += [per_token.shape[1]] * per_token.shape[0]
            position_nll[:per_token.shape[1]] += per_token.sum(axis=0)
            position_tokens[:per_token.shape[1]] += per_token.shape[0]
            bar.update(stop - start)
            heartbeat.progress()
            start = stop
    return {"nll": nll, "tokens": tokens, "position_nll": position_nll.tolist(),
            "position_tokens": position_tokens.tolist()}


def merge_scores(first: dict, then: dict) -> dict:
    """window_scores of some windows followed by window_scores of the next ones, as one."""
    length = max(len(first["position_nll"]), len(then["position_nll"]))
    padded = {key: [np.pad(np.asarray(scores[key], float), (0, length - len(scores[key]))) for scores in (first, then)]
              for key in ("position_nll", "position_tokens")}
    return {"nll": first["nll"] + then["nll"], "tokens": first["tokens"] + then["tokens"],
            "position_nll": (padded["position_nll"][0] + padded["position_nll"][1]).tolist(),
            "position_tokens": (padded["position_tokens"][0] + padded["position_tokens"][1]).astype(int).tolist()}


def continues(scores: dict, windows, articles) -> bool:
    """Whether saved per-window scores are those of the first len(scores['nll']) of `windows`
    (same token counts, same articles), so that scoring may go on from them."""
    n = len(scores["nll"])
    return scores["tokens"] == [len(w) - 1 for w in windows[:n]] and scores["article"] == list(articles[:n])


def score_in_turn(readings: dict, save: Callable[[str, dict, int, float], None], progress: bool = False) -> None:
    """Scores several readings window by window in turn: window i with every reading, then window i + 1.

    Stopped at any point, the readings hold scores on the same windows, which is what a paired comparison
    needs; each goes on from the scores it already holds. `readings` maps a name to (token_nll, windows,
    scores so far: a merge_scores-shaped dict, updated in place). After every scored window,
    `save(name, scores, index, seconds)` is called, so a crash loses at most one window. `progress`: a line
    per window on stdout.
    """
    first = min(len(scores["nll"]) for _, _, scores in readings.values())
    last = max(len(windows) for _, windows, _ in readings.values())
    for index in range(first, last):
        for name, (token_nll, windows, scores) in readings.items():
            if len(scores["nll"]) > index or index >= len(windows):
                continue
            start = time.perf_counter()
            scores.update(merge_scores(scores, window_scores(None, [windows[index]], token_nll=token_nll)))
            save(name, scores, index, time.perf_counter() - start)
        if progress:
            print(f"window {index + 1} of {last} scored for {', '.join(readings)}", flush=True)


def summary(scores: dict) -> dict:
    """{'perplexity', 'nll', 'tokens', 'windows'} of window_scores' output."""
    scored = sum(scores["tokens"])
    nll = sum(scores["nll"]) / scored
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": scored, "windows": len(scores["nll"])}


def perplexity(model, windows, batch_size: int = 1, progress: bool = False) -> dict:
    """{'perplexity', 'nll', 'tokens', 'windows'} of `model` over token windows [N, L]."""
    return summary(window_scores(model, windows, batch_size, progress))
