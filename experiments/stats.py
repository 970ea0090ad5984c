"""The statistics every experiment report uses: paired bootstraps, shares of a gap, intervals of a
proportion, McNemar's exact test, and the training-seed spread a claim between two configurations
must exceed.

Per-window results are dicts of equal-length lists {"article", "nll", "tokens"} (one entry per
scored window: its article, its summed NLL and its token count), as `linjax eval perplexity`
writes them; two rows compared must have been scored on the same windows.
"""

from __future__ import annotations

import math

import numpy as np

BOOTSTRAP_DRAWS = 10_000
FEW_ARTICLES = 20  # below this many articles a resample has few distinct outcomes: a rough interval
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


# ----------------------------------------------------------------------------- perplexity


def resampled_log_ppl(rows, draws=BOOTSTRAP_DRAWS, seed=0):
    """(points [rows], samples [rows, draws]): each row's log-perplexity on the windows, and in `draws`
    resamples of the articles with replacement. Every row draws the same articles in a resample (the
    comparison is paired), and an article's windows go together (they are not independent)."""
    first = rows[0]
    if any(r["tokens"] != first["tokens"] or r["article"] != first["article"] for r in rows[1:]):
        raise ValueError("the rows were not scored on the same windows")
    index = {k: i for i, k in enumerate(sorted(set(first["article"])))}
    which = np.array([index[k] for k in first["article"]])
    tokens = np.bincount(which, np.asarray(first["tokens"], np.float64))  # per article: tokens, NLL sums
    nll = np.stack([np.bincount(which, np.asarray(r["nll"], np.float64), len(tokens)) for r in rows])
    # How often each article is drawn, in each of `draws` resamples of as many articles as there are.
    counts = np.random.default_rng(seed).multinomial(len(tokens), np.full(len(tokens), 1 / len(tokens)), size=draws)
    return nll.sum(axis=1) / tokens.sum(), (nll @ counts.T) / (counts @ tokens)


def log_ppl(row) -> float:
    """A row's log-perplexity on its scored windows."""
    return float(np.sum(row["nll"]) / np.sum(row["tokens"]))


def paired_bootstrap(a, b, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): log-perplexity of `a` minus that of `b`, scored on the same windows, with its
    95% percentile interval from resampling articles (`resampled_log_ppl`)."""
    points, samples = resampled_log_ppl([a, b], draws, seed)
    low, high = np.percentile(samples[0] - samples[1], [2.5, 97.5])
    return float(points[0] - points[1]), float(low), float(high)


def gap_closed(row, window, original, draws=BOOTSTRAP_DRAWS, seed=0, scale="log"):
    """(point, low, high): the share of the window-only model's excess over the original that `row`
    removes, on windows all three have scored, with its 95% interval from resampling articles
    (`resampled_log_ppl`). `scale` "log": of the log-perplexity, (L_window − L_row) / (L_window −
    L_original); "ppl": of the perplexity itself, (P_window − P_row) / (P_window − P_original). A share
    on the perplexity scale is larger than on the log scale for a row between the two (perplexity is
    convex in log-perplexity)."""
    if scale not in ("log", "ppl"):
        raise ValueError(f"scale must be 'log' or 'ppl', got {scale!r}")
    points, samples = resampled_log_ppl([row, window, original], draws, seed)
    if scale == "ppl":
        points, samples = np.exp(points), np.exp(samples)
    (r, w, o), (rs, ws, os_) = points, samples
    low, high = np.percentile((ws - rs) / (ws - os_), [2.5, 97.5])
    return float((w - r) / (w - o)), float(low), float(high)


def gap_share_difference(a, b, window, original, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): how much more of the window-only -> original gap `a` closes than `b`, on the
    log scale, (L_b − L_a) / (L_window − L_original), all four scored on the same windows, with its 95%
    interval from resampling articles (`resampled_log_ppl`; every row draws the same articles). It is
    `gap_closed(a) − gap_closed(b)`, resampled jointly: what one lever adds to the share."""
    points, samples = resampled_log_ppl([a, b, window, original], draws, seed)
    (pa, pb, w, o), (sa, sb, sw, so) = points, samples
    low, high = np.percentile((sb - sa) / (sw - so), [2.5, 97.5])
    return float((pb - pa) / (w - o)), float(low), float(high)


def fmt_interval(interval, scored=None) -> str:
    """"-0.0174 [-0.0211, -0.0135] (ppl ×0.983)", and with `scored` (windows, articles, of) how many windows
    and articles it rests on."""
    if interval is None:
        return "—"
    point, low, high = interval
    text = f"{point:+.4f} [{low:+.4f}, {high:+.4f}] (ppl ×{math.exp(point):.3f})"
    if scored:
        windows, articles, of = scored
        text += f"; {windows} windows in {articles} articles" + ("" if windows == of else f" (of {of}: partial)")
        if articles < FEW_ARTICLES:
            text += "; few articles: a rough interval"
    return text


# ----------------------------------------------------------------------------- accuracy


def paired_accuracy_bootstrap(a, b, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): LAMBADA accuracy of `a` minus that of `b` in percentage points, both scored on
    the same examples (lists of `linjax eval lambada` per-example results), with its 95% percentile
    interval from resampling examples with replacement. Per example the difference is +1, -1 or 0, so a
    resample is fully described by how many of each it draws: one multinomial draw of three counts."""
    if len(a) != len(b):
        raise ValueError("the rows were not scored on the same LAMBADA examples")
    diff = np.array([int(x["greedy"]) - int(y["greedy"]) for x, y in zip(a, b)])
    shares = np.array([(diff == 1).mean(), (diff == -1).mean(), (diff == 0).mean()])
    counts = np.random.default_rng(seed).multinomial(len(diff), shares, size=draws)
    samples = 100 * (counts[:, 0] - counts[:, 1]) / len(diff)
    low, high = np.percentile(samples, [2.5, 97.5])
    return float(100 * diff.mean()), float(low), float(high)


def paired_accuracy_difference(a, b, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): accuracy of `a` minus that of `b` (lists of booleans on the same examples), in
    points, with its 95% percentile interval from resampling the examples' indices."""
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    picks = np.random.default_rng(seed).integers(0, len(diff), (draws, len(diff)))
    means = diff[picks].mean(axis=1)
    return tuple(100 * float(x) for x in (diff.mean(), np.percentile(means, 2.5), np.percentile(means, 97.5)))


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `accuracy` measured on n samples (95% by default).
    Unlike accuracy ± z·se it stays inside [0, 1] and is not empty at 0 or 1 of n."""
    if n < 1:
        raise ValueError(f"an interval needs at least one sample, got n={n}")
    centre = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact two-sided p-value for two readings of the same samples: `only_a` samples right in
    the first only, `only_b` in the second only (the discordant pairs; the concordant ones say nothing).
    Under no difference each discordant pair goes either way with probability 1/2."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be ≥ 0, got {only_a} and {only_b}")
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


# ----------------------------------------------------------------------------- training seeds


def pooled_sd(groups) -> float | None:
    """The pooled standard deviation of the groups' values (each group: one configuration's log-perplexity
    per training seed), √(Σ (n_i − 1) s_i² / Σ (n_i − 1)) over the groups with two values or more; None
    if there are none."""
    squares = dof = 0.0
    for values in groups:
        if len(values) >= 2:
            squares += (len(values) - 1) * float(np.var(values, ddof=1))
            dof += len(values) - 1
    return math.sqrt(squares / dof) if dof else None


def seed_threshold(sd: float, better_seeds: int | None, worse_seeds: int | None) -> float:
    """How far apart two configurations' mean log-perplexities over their seeds must be to count beyond the
    training-seed noise: 2 · SD · √(1/n_better + 1/n_worse), two standard errors of the difference of
    the means (2·√2·SD with one seed each). None for a side that is not trained (it has no seed noise)."""
    spread = sum(1 / n for n in (better_seeds, worse_seeds) if n)
    return 2 * sd * math.sqrt(spread)


def seed_aware_verdict(interval, seed_difference, threshold) -> str:
    """A claim that configuration `better` beats `worse`, from `interval` (point, low, high) of the paired
    log-perplexity difference over the test text (seed 1 against seed 1) and `seed_difference`, the
    difference of their mean log-perplexities over all their seeds: it **holds** when the interval is
    below 0 and the seed difference below −threshold, **does not hold** when the interval is above 0 and
    the seed difference above +threshold, and is **undecided** otherwise, with the reason."""
    if interval is None:
        return "undecided (no per-window results)"
    _, low, high = interval
    if low <= 0 <= high:
        return "undecided (interval spans 0)"
    if seed_difference is None or threshold is None:
        return "undecided (no seed spread measured)"
    if abs(seed_difference) <= threshold:
        return f"undecided (|Δ| {abs(seed_difference):.4f} within the seed spread {threshold:.4f})"
    if high < 0 and seed_difference < 0:
        return "holds"
    if low > 0 and seed_difference > 0:
        return "does not hold"
    return "undecided (the interval and the seeds disagree)"
