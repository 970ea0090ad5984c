"""`linjax eval lambada`: LAMBADA scored in JAX, example by example as lm-eval's lambada_openai scores it."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import require_embedded_model, require_module

EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lm_eval_expected_smollm2.json")
LOGLIKELIHOOD_ATOL = 2e-3  # as tests/test_lm_eval.py: linjax's and transformers' dequantisation of one GGUF


@pytest.fixture(scope="module")
def tiny_gdn(tmp_path_factory, tokenizer):
    """(the model, its PyTorch export's directory): a tiny LLaMA linearized with GDN + window 8 + 2 sinks +
    short conv, long enough for every LAMBADA text."""
    from flax import nnx

    import linjax
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    base = CausalLM(tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                max_position_embeddings=512), rngs=nnx.Rngs(2))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=8, sinks=2, adapter="shortconv"))
    return model, linjax.save_hf(model, str(tmp_path_factory.mktemp("tiny-gdn-lambada") / "model"), tokenizer)


def test_the_original_model_scores_as_lm_evals_hflm(shared_data):
    """The first documents of the committed fixture (SmolLM2-135M, lm-eval's stock HFLM on transformers'
    model): the same targets, log-likelihoods within the fixture's tolerance and the same greedy flags."""
    require_embedded_model()
    import linjax
    from linjax.eval import lambada

    with open(EXPECTED) as f:
        expected = json.load(f)["samples"]["lambada_openai"]
    texts = lambada.read_texts(shared_data, limit=len(expected))
    model, tokenizer = linjax.load("smollm2-135m")
    ours = lambada.score(model, tokenizer, texts, batch_size=3)  # a second, partly padded batch
    assert len(ours) == len(expected) == len(texts)
    for text, reference, mine in zip(texts, expected, ours):
        assert reference["target"] == " " + text.rsplit(" ", 1)[1]
        assert abs(mine["loglikelihood"] - reference["loglikelihoods"][0]) <= LOGLIKELIHOOD_ATOL
        assert mine["greedy"] == reference["is_greedy"][0]


def test_a_linearized_model_scores_as_lm_eval_on_its_export(tiny_gdn, tokenizer, shared_data, tmp_path):
    """lm-eval (HFLM on the PyTorch export, through linjax's bridge) and the JAX scorer agree on every
    example of a linearized model: texts longer than its window and sinks, targets of several tokens,
    batches padded to different lengths."""
    require_module("lm_eval", "pip install -e '.[eval]'")
    from linjax.eval import lambada, lm_eval_bridge

    model, export = tiny_gdn
    limit = 12
    lm_eval_bridge.run(export, tasks=["lambada_openai"], data_dir=shared_data, limit=limit, batch_size=4,
                       out_dir=str(tmp_path / "lm-eval"), samples=True)
    with open(tmp_path / "lm-eval" / "samples_lambada_openai.jsonl") as f:
        reference = sorted((json.loads(line) for line in f), key=lambda record: record["doc_id"])
    texts = lambada.read_texts(shared_data, limit)
    ours = lambada.score(model, tokenizer, texts, batch_size=5)
    assert max(len(lambada.encode(tokenizer, text)[0]) for text in texts) > 8 + 2  # beyond the cache
    assert max(example["target_tokens"] for example in ours) > 1
    for theirs, mine in zip(reference, ours, strict=True):
        expected = theirs["loglikelihoods"][0]
        assert abs(mine["loglikelihood"] - expected) <= 1e-4 * max(1.0, abs(expected))
        assert mine["greedy"] == theirs["is_greedy"][0]


def test_the_command_writes_resumes_and_refuses_to_overwrite(tiny_source, shared_data, tmp_path):
    from linjax.app.cli import main

    out = str(tmp_path / "lambada.json")
    arguments = ["eval", "lambada", tiny_source, "--data-dir", shared_data, "--limit", "5", "--batch-size", "2",
                 "--out", out]
    main(arguments)
    with open(out) as f:
        whole = json.load(f)
    assert whole["complete"] and whole["scored"] == 5 and len(whole["examples"]) == 5
    assert 0 <= whole["acc"] <= 1 and whole["perplexity"] > 1
    with pytest.raises(SystemExit):  # results there: refused without --resume or --overwrite
        main(arguments)
    with open(out, "w") as f:  # as a run stopped after its first batch leaves it
        json.dump({**{key: whole[key] for key in ("model", "data", "limit", "dtype")}, "complete": False,
                   "examples": whole["examples"][:2]}, f)
    main(arguments + ["--resume"])
    with open(out) as f:
        resumed = json.load(f)
    assert resumed["examples"] == whole["examples"] and resumed["perplexity"] == whole["perplexity"]
    with pytest.raises(SystemExit):  # other settings: refused in one line
        main(["eval", "lambada", tiny_source, "--data-dir", shared_data, "--limit", "4", "--out", out, "--resume"])
