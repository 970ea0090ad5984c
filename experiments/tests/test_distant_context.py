"""experiments/distant_context.py: the swap leaves the 64-token cache as it is, and its report's arithmetic."""

import json

import numpy as np
import pytest

import linjax
from experiments.tests.helpers import experiment_script
from linjax.eval.perplexity import token_nll_function


@pytest.fixture(scope="module")
def distant():
    return experiment_script("distant_context.py")


def test_donors_start_in_another_article_and_only_the_middle_is_swapped(distant):
    windows = [np.arange(i * 10, i * 10 + 10) for i in range(9)] + [np.arange(3)]  # the short last one is skipped
    articles = [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    pairs = distant.chosen_windows(windows, articles, stride=2)
    assert [i for i, _ in pairs] == [0, 2, 4, 6, 8]
    assert all(articles[d] != articles[i] and len(windows[d]) == 10 for i, d in pairs)
    out = distant.swapped(windows[0], windows[5], sinks=2, kept_tail=3)
    assert out.tolist() == [0, 1, 52, 53, 54, 55, 56, 7, 8, 9]
    assert windows[0].tolist() == list(range(10))  # the window itself is not changed


def test_window_only_reads_the_swap_only_within_its_reach_through_depth(distant, tiny_source):
    """Sinks 8 + window 56 at 256 tokens (the run's geometry at the window's end), two layers: a
    softmax-only model's last 64 predictions reach 2 x 56 tokens further back than their own window, so a
    swap ending before that reach leaves them as they were, and one ending inside it does not; a GDN +
    window model reads even the distant swap."""
    base, _ = linjax.load(tiny_source)
    rng = np.random.default_rng(0)
    window, donor = (rng.integers(0, 1000, 256).astype(np.int32) for _ in range(2))
    beyond_reach = distant.swapped(window, donor, kept_tail=distant.SCORED + 2 * 56 + 8)
    within_reach = distant.swapped(window, donor)  # the run's swap: kept tail 120
    assert (within_reach[-distant.KEPT_TAIL:] == window[-distant.KEPT_TAIL:]).all()
    for mechanism, reads in (("window", {"beyond": False, "within": True}), ("gdn", {"beyond": True, "within": True})):
        model = linjax.linearize(base, linjax.LinearizeConfig(mechanism=mechanism, window=56, sinks=8), seed=0)
        nll = distant.tail_nll(token_nll_function(model))
        as_is = nll(window[None])
        assert as_is.shape == (1, distant.SCORED)
        for name, changed in (("beyond", beyond_reach), ("within", within_reach)):
            difference = np.abs(as_is - nll(changed[None])).max()
            assert (difference > 1e-4) == reads[name], (mechanism, name, difference)
            assert reads[name] or difference < 1e-5


def cell(nll_per_window, articles):
    return {"complete": True, "stride": 8, "window": list(range(len(articles))), "article": articles,
            "nll": [64 * x for x in nll_per_window], "tokens": [64] * len(articles)}


def test_the_report_reads_the_kept_share(distant, tmp_path, monkeypatch):
    monkeypatch.setattr(distant, "CELLS", str(tmp_path))
    assert "Not run yet" in "\n".join(distant.swap_lines())
    articles = [0, 0, 1, 2, 3, 4]
    rng = np.random.default_rng(1)
    window = 3.5 + rng.uniform(0, 0.5, len(articles))
    final = window - 0.2
    for reading, nll in {"window-only": window, "window-only-swapped": window + 0.1, "final": final,
                         "final-swapped": final + 0.15,
                         "original": window - 0.8, "original-swapped": window - 0.6}.items():
        (tmp_path / f"{reading}.json").write_text(json.dumps(cell(nll.tolist(), articles)))
    text = "\n".join(distant.swap_lines())
    assert "gain over window-only kept after the swap: 75% [75%, 75%]" in text  # 0.15 of 0.2, in every draw
