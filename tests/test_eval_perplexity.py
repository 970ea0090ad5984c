"""`linjax eval perplexity`: the scored tokens and the number itself, from the command line."""

import json
import math

import numpy as np

import linjax
from linjax.app.cli import main
from linjax.eval.perplexity import perplexity, token_windows
from tests.helpers import missing

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def test_perplexity_equals_a_direct_computation(tiny_source, tokenizer):
    model, _ = linjax.load(tiny_source)
    windows = token_windows(tokenizer, TEXT, seq_len=32, max_windows=3)
    assert windows.shape == (3, 32)
    result = perplexity(model, windows, batch_size=2)
    logits = np.asarray(model(windows[:, :-1]), np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(log_probs, windows[:, 1:, None], axis=-1).mean()
    assert result["tokens"] == 3 * 31
    np.testing.assert_allclose(result["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(result["perplexity"], math.exp(nll), rtol=1e-5)


def test_cli_scores_a_model_and_an_untrained_experiment(tiny_source, tmp_path, capsys):
    data = tmp_path / "held_out.txt"
    data.write_text(TEXT)
    experiment = tmp_path / "exp.toml"
    experiment.write_text(f'run_dir = "{tmp_path / "run"}"\n[model]\nsource = "{tiny_source}"\n'
                          f'[linearize]\nmechanism = "gla"\nwindow = 0\nsinks = 0\n[data]\npaths = ["{data}"]\n'
                          '[train]\nseed = 2\n')
    out = tmp_path / "ppl.json"
    main(["eval", "perplexity", tiny_source, str(experiment), "--data", str(data), "--seq-len", "32",
          "--max-windows", "2", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["windows"] for r in results] == [2, 2]
    assert "untrained" in results[1]["model"]
    # The linearized model is a different function of the same text: a different, finite number.
    assert all(np.isfinite(r["perplexity"]) for r in results)
    assert results[0]["perplexity"] != results[1]["perplexity"]
    assert "| model | perplexity |" in capsys.readouterr().out


def test_too_short_text_is_a_clear_error(tokenizer):
    import pytest

    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tokenizer, "short", seq_len=1024)



ARTICLES = "".join(f" = Article {k} = \r\n" + f" Sentence {k} of the article about topic {k} .\r\n" * (9 + 5 * k)
                   + f" = = Section {k} = = \r\n Closing words .\r\n" for k in range(4))


def test_per_window_sums_add_up_to_the_total(tiny_source, tokenizer):
    from linjax.eval.perplexity import window_scores

    model, _ = linjax.load(tiny_source)
    windows = token_windows(tokenizer, TEXT, seq_len=32, max_windows=5)
    scores = window_scores(model, windows, batch_size=2)
    total = perplexity(model, windows, batch_size=5)
    assert scores["tokens"] == [31] * 5 and len(scores["nll"]) == 5
    np.testing.assert_allclose(sum(scores["nll"]) / sum(scores["tokens"]), total["nll"], rtol=1e-6)
    # Summed over windows per position, the same total again; each position scored once per window.
    np.testing.assert_allclose(sum(scores["position_nll"]), sum(scores["nll"]), rtol=1e-9)
    assert scores["position_tokens"] == [5] * 31


def test_windows_know_the_article_they_start_in(tokenizer):
    from linjax.eval.perplexity import article_starts, text_windows

    assert len(article_starts(ARTICLES)) == 4  # sections (" = = Section = = ") do not start articles
    windows, articles = text_windows(tokenizer, ARTICLES, seq_len=16)
    assert articles == sorted(articles) and articles[0] == 0 and articles[-1] == 3
    headings = [i for i in range(len(ARTICLES)) if ARTICLES.startswith(" = Article ", i)]
    for i, article in enumerate(articles):  # the window starts after `article + 1` headings have begun
        start = len(tokenizer.decode(np.concatenate(windows[:i]).tolist())) if i else 0
        assert article == sum(h <= start for h in headings) - 1


def test_a_whole_file_run_covers_every_token_once(tokenizer):
    from linjax.eval.perplexity import text_windows

    ids = tokenizer(ARTICLES, add_special_tokens=False)["input_ids"]
    assert len(ids) % 16 >= 2  # so the text has a shorter last window
    windows, articles = text_windows(tokenizer, ARTICLES, seq_len=16, whole_file=True)
    assert np.concatenate(windows).tolist() == ids
    assert [len(w) for w in windows[:-1]] == [16] * (len(windows) - 1) and len(windows[-1]) == len(ids) % 16
    assert len(articles) == len(windows)
    partial, _ = text_windows(tokenizer, ARTICLES, seq_len=16)
    assert len(partial) == len(windows) - 1  # without it, the tail is not scored


def test_cli_saves_per_window_results_beside_the_summary(tiny_source, tmp_path, tokenizer):
    data = tmp_path / "articles.txt"
    data.write_text(ARTICLES, newline="")
    out = tmp_path / "ppl.json"
    main(["eval", "perplexity", tiny_source, "--data", str(data), "--seq-len", "16", "--whole-file",
          "--out", str(out)])
    summary = json.loads(out.read_text())["results"][0]
    windows = json.loads((tmp_path / "ppl.windows.json").read_text())["results"][0]
    ids = tokenizer(ARTICLES.replace("\r\n", "\n"), add_special_tokens=False)["input_ids"]  # as open() reads it
    assert sum(windows["tokens"]) + len(windows["tokens"]) == len(ids) == summary["tokens"] + summary["windows"]
    np.testing.assert_allclose(sum(windows["nll"]), summary["nll"] * summary["tokens"], rtol=1e-9)
    assert len(windows["article"]) == summary["windows"] and windows["article"][-1] == 3


def test_wikitext2_test_file_has_62_article_headings_in_order(tokenizer):
    import os

    from linjax.eval.perplexity import article_starts, text_windows

    path = os.path.join(os.environ.get("LINJAX_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..",
                                                                        "shared", "data")),
                        "wikitext", "wikitext-2-raw-v1.test.nonblank.raw")
    if not os.path.exists(path):
        missing(f"WikiText-2 test file not found at {path} (set LINJAX_DATA_DIR)")
    with open(path, encoding="utf-8") as f:  # as `linjax eval perplexity` reads it
        text = f.read()
    assert len(article_starts(text)) == 62
    windows, articles = text_windows(tokenizer, text, seq_len=1024, whole_file=True)
    assert articles[0] == 0 and articles[-1] == 61 and articles == sorted(articles)
    assert len(set(articles[:64])) == 12  # the first 64 windows, the claims rows' evaluation, start in 12


def test_scores_window_by_window_merge_into_the_scores_of_all(tiny_source, tokenizer):
    from linjax.eval.perplexity import merge_scores, text_windows, token_nll_function, window_scores

    model, _ = linjax.load(tiny_source)
    windows, _ = text_windows(tokenizer, ARTICLES, seq_len=16, whole_file=True)
    windows = windows[-4:]  # three full windows and the shorter last one
    together = window_scores(model, windows, batch_size=4)
    nll = token_nll_function(model)
    merged = {"nll": [], "tokens": [], "position_nll": [], "position_tokens": []}
    for window in windows:
        merged = merge_scores(merged, window_scores(None, [window], token_nll=nll))
    assert merged["tokens"] == together["tokens"] and merged["position_tokens"] == together["position_tokens"]
    np.testing.assert_allclose(merged["nll"], together["nll"], rtol=1e-5)
    np.testing.assert_allclose(merged["position_nll"], together["position_nll"], rtol=1e-5)


def test_readings_scored_in_turn_go_on_from_what_they_hold(tiny_source, tokenizer):
    from linjax.eval.perplexity import continues, score_in_turn, text_windows, token_nll_function, window_scores

    model, _ = linjax.load(tiny_source)
    windows, articles = text_windows(tokenizer, ARTICLES, seq_len=16, whole_file=True)
    windows, articles = windows[-4:], articles[-4:]
    together = window_scores(model, windows, batch_size=4)
    nll = token_nll_function(model)
    held = {"nll": [], "tokens": [], "position_nll": [], "position_tokens": []}
    score_in_turn({"ahead": (nll, windows[:2], held)}, lambda *_: None)  # a reading stopped after two windows
    assert continues({**held, "article": articles[:2]}, windows, articles)
    assert not continues({**held, "tokens": [1, 1], "article": articles[:2]}, windows, articles)  # other windows
    assert not continues({**held, "article": [articles[0] + 1] * 2}, windows, articles)  # other articles
    fresh = {"nll": [], "tokens": [], "position_nll": [], "position_tokens": []}
    saved = []
    score_in_turn({"ahead": (nll, windows, held), "fresh": (nll, windows, fresh)},
                  lambda name, scores, index, seconds: saved.append((name, index, len(scores["nll"]))))
    # window by window, each reading scored once per window it lacks: the fresh one catches up first
    assert saved == [("fresh", 0, 1), ("fresh", 1, 2), ("ahead", 2, 3), ("fresh", 2, 3), ("ahead", 3, 4),
                     ("fresh", 3, 4)]
    for scores in (held, fresh):
        assert scores["tokens"] == together["tokens"]
        np.testing.assert_allclose(scores["nll"], together["nll"], rtol=1e-5)
        np.testing.assert_allclose(scores["position_nll"], together["position_nll"], rtol=1e-5)


def test_whole_file_and_a_window_limit_are_refused_together(tokenizer):
    import pytest

    from linjax.eval.perplexity import text_windows

    with pytest.raises(ValueError, match="drop --max-windows"):
        text_windows(tokenizer, ARTICLES, seq_len=16, max_windows=2, whole_file=True)
