"""`linjax eval perplexity`: the scored tokens and the number itself, from the command line."""

import json
import math

import numpy as np

import linjax
from linjax.app.cli import main
from linjax.eval.perplexity import perplexity, token_windows

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

