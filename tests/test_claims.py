"""results/claims.py's paired bootstrap over articles: a known difference is found, none is undecided."""

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def claims():
    spec = importlib.util.spec_from_file_location("claims", os.path.join(ROOT, "results", "claims.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scored_rows(per_token_difference, seed=0, articles=60, windows_per_article=5, tokens=1023):
    """Two rows' per-window results on the same windows: articles differ a lot in difficulty (shared by
    both rows), each row adds its own noise per window, and row a is `per_token_difference` nats per
    token above row b on average."""
    rng = np.random.default_rng(seed)
    article = np.repeat(np.arange(articles), windows_per_article)
    difficulty = rng.uniform(2.5, 4.5, articles)[article]
    b = (difficulty + rng.normal(0, 0.05, article.size)) * tokens
    a = b + (per_token_difference + rng.normal(0, 0.05, articles)[article]) * tokens
    counts = [tokens] * article.size
    return ({"article": article.tolist(), "nll": a.tolist(), "tokens": counts},
            {"article": article.tolist(), "nll": b.tolist(), "tokens": counts})


def test_a_known_difference_is_found(claims):
    better, worse = scored_rows(-0.1)
    point, low, high = claims.paired_bootstrap(better, worse)
    assert low < point < high < 0 and low < -0.1 < high
    assert claims.interval_verdict((point, low, high)) == "holds"
    assert claims.interval_verdict(claims.paired_bootstrap(worse, better)) == "does not hold"


def test_no_difference_is_undecided(claims):
    better, worse = scored_rows(0.0, seed=1)
    point, low, high = claims.paired_bootstrap(better, worse)
    assert low < 0 < high
    assert claims.interval_verdict((point, low, high)).startswith("undecided")


def test_the_bootstrap_is_paired_and_seeded(claims):
    better, worse = scored_rows(-0.01, seed=2)
    first = claims.paired_bootstrap(better, worse)
    assert claims.paired_bootstrap(better, worse) == first  # a fixed seed: the same interval every time
    # The articles' shared difficulty cancels in the pairing: the interval is far narrower than the
    # spread of either row's per-article perplexity.
    assert first[2] - first[1] < 0.05


def test_rows_without_per_window_results_or_on_other_windows_are_not_compared(claims):
    assert claims.interval_verdict(None) == "undecided (no per-window results)"
    better, worse = scored_rows(-0.1)
    with pytest.raises(ValueError, match="same windows"):
        claims.paired_bootstrap(better, {**worse, "tokens": worse["tokens"][:-1]})


def test_the_report_of_the_committed_rows(claims, monkeypatch):
    """`report` on the committed rows (written to a string here, not to claims.md): every claim of two
    evaluated rows has its earlier verdict and an interval verdict, and the header states the facts
    the issue found missing."""
    written = {}
    monkeypatch.setattr(claims, "write_text", lambda path, text: written.setdefault("text", text) and path)
    claims.report()
    text = written["text"]
    assert "10M tokens (2,500 steps x 4,096)" in text and "20M" not in text
    assert "SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF" in text
    assert "| 1,000 + 1,000 | 1 then 2 |" in text  # the two-stage row's steps and seeds
    for claim, *_ in claims.CLAIMS:
        line = next(line for line in text.splitlines() if line.startswith(f"| {claim} |"))
        by_interval, earlier = line.strip("| ").split(" | ")[-2:]
        assert by_interval.split(" (")[0] in ("holds", "does not hold", "undecided")
        assert earlier != "pending"
