"""`linjax eval lm-eval`: local task files (parsing, prompts) and end-to-end runs through lm-eval."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import require_embedded_model, require_module

require_module("lm_eval", "pip install -e '.[eval]'")

from linjax.eval import lm_eval_bridge  # noqa: E402

ARC_CHALLENGE = [
    {"id": "Mercury_7175875", "question": {"stem": "An astronomer observes that a planet rotates faster after a "
     "meteorite impact. Which is the most likely effect of this increase in rotation?", "choices": [
        {"text": "Planetary density will decrease.", "label": "A"},
        {"text": "Planetary years will become longer.", "label": "B"},
        {"text": "Planetary days will become shorter.", "label": "C"},
        {"text": "Planetary gravity will become stronger.", "label": "D"}]}, "answerKey": "C"},
    {"id": "NYSEDREGENTS_2015_4_8", "question": {"stem": "Which object is a good conductor of electricity?",
     "choices": [{"text": "a wooden spoon", "label": "1"}, {"text": "a plastic cup", "label": "2"},
                 {"text": "a metal nail", "label": "3"}, {"text": "a rubber band", "label": "4"}]},
     "answerKey": "3"},
    {"id": "Mercury_SC_401", "question": {"stem": "Which of these is a mammal?", "choices": [
        {"text": "shark", "label": "A"}, {"text": "frog", "label": "B"}, {"text": "eagle", "label": "C"},
        {"text": "snake", "label": "D"}, {"text": "whale", "label": "E"}]}, "answerKey": "E"},
]
WINOGRANDE = [
    {"qID": "1", "sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
     "option1": "Sarah", "option2": "Maria", "answer": "1"},
    {"qID": "2", "sentence": "The trophy doesn't fit into the suitcase because the _ is too small.",
     "option1": "trophy", "option2": "suitcase", "answer": "2"},
    {"qID": "3", "sentence": "John poured water from the bottle into the cup until the _ was full.",
     "option1": "bottle", "option2": "cup"},  # no answer field: dev-labels.lst gives it
]


def _write_fixtures(root, labels=True):
    os.makedirs(os.path.join(root, "arc"), exist_ok=True)
    os.makedirs(os.path.join(root, "winogrande"), exist_ok=True)
    with open(os.path.join(root, "arc", "ARC-Challenge-Test.jsonl"), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in ARC_CHALLENGE)
    with open(os.path.join(root, "winogrande", "dev.jsonl"), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in WINOGRANDE)
    if labels:
        with open(os.path.join(root, "winogrande", "dev-labels.lst"), "w") as f:
            f.write("1\n2\n2\n")


def _full_data_dir(root, shared):
    """The shared data folder plus the ARC-Challenge and WinoGrande fixtures (symlinks, nothing copied)."""
    _write_fixtures(root)
    for name in ("piqa", "hellaswag", "mmlu", "lambada"):
        os.symlink(os.path.join(shared, name), os.path.join(root, name))
    for name in os.listdir(os.path.join(shared, "arc")):
        os.symlink(os.path.join(shared, "arc", name), os.path.join(root, "arc", name))
    return root


def test_arc_challenge_and_winogrande_fixtures(tmp_path):
    _write_fixtures(str(tmp_path))
    tasks = lm_eval_bridge.load_tasks(["arc_challenge", "winogrande"], str(tmp_path))
    arc, wino = tasks["linjax_arc_challenge"], tasks["linjax_winogrande"]
    docs = list(arc.eval_docs)
    assert len(docs) == 3
    assert [arc.doc_to_target(d) for d in docs] == [2, 2, 4]  # C, "3" of 1-4, E of A-E
    assert arc.doc_to_text(docs[1]) == "Question: Which object is a good conductor of electricity?\nAnswer:"
    assert arc.doc_to_choice(docs[2])[4] == "whale"
    docs = list(wino.eval_docs)
    assert len(docs) == 3
    assert [wino.doc_to_text(d) for d in docs] == [0, 1, 1]  # the gold context index (partial scoring)
    assert wino.doc_to_choice(docs[1]) == ["The trophy doesn't fit into the suitcase because the trophy",
                                           "The trophy doesn't fit into the suitcase because the suitcase"]
    assert wino.doc_to_target(docs[1]) == "is too small."


def test_missing_labels_and_unknown_task(tmp_path):
    _write_fixtures(str(tmp_path), labels=False)
    with pytest.raises(Exception, match="no answer"):
        list(lm_eval_bridge.load_tasks(["winogrande"], str(tmp_path))["linjax_winogrande"].eval_docs)
    with pytest.raises(ValueError, match="unknown task"):
        lm_eval_bridge.task_name("boolq", local=True)


def test_shared_data_parsed(shared_data):
    tasks = lm_eval_bridge.load_tasks(["piqa", "hellaswag", "mmlu_anatomy", "lambada_openai"], shared_data)
    piqa, hs = tasks["linjax_piqa"], tasks["linjax_hellaswag"]
    mmlu, lam = tasks["linjax_mmlu_anatomy"], tasks["linjax_lambada_openai"]
    assert len(list(piqa.eval_docs)) == 1838 and len(list(hs.eval_docs)) == 10042
    assert len(list(lam.eval_docs)) == 5153 and len(list(mmlu.eval_docs)) == 135
    d = list(hs.eval_docs)[0]
    assert hs.doc_to_text(d) == "Roof shingle removal: A man is sitting on a roof. He"  # as lm-eval's
    assert hs.doc_to_target(d) == 3
    assert mmlu.config.description == "The following are multiple choice questions (with answers) about anatomy.\n\n"
    assert len(list(mmlu.fewshot_docs())) == 5


@pytest.mark.slow  # lm-eval builds every paper task, MMLU's 57 among them
def test_end_to_end_tiny_all_tasks(tiny_source, shared_data, tmp_path):
    data = _full_data_dir(str(tmp_path / "data"), shared_data)
    out = str(tmp_path / "out")
    result = lm_eval_bridge.run(tiny_source, tasks=list(lm_eval_bridge.PAPER_TASKS), data_dir=data, limit=2,
                                batch_size=4, out_dir=out)
    assert result["limit"] == 2 and result["num_fewshot"]["mmlu"] == 5 and result["num_fewshot"]["piqa"] == 0
    for task in lm_eval_bridge.PAPER_TASKS:
        assert task in result["results"], task
        assert f"| {task} | acc |" in result["table_markdown"]
    assert 0 <= result["results"]["piqa"]["acc,none"] <= 1
    assert result["results"]["lambada_openai"]["perplexity,none"] > 1
    assert result["n-samples"]["arc_challenge"]["effective"] == 2
    with open(os.path.join(out, "lm_eval_results.json")) as f:
        assert json.load(f)["table_markdown"] == result["table_markdown"]
    assert "| task | metric | value | stderr |" in open(os.path.join(out, "results.md")).read()


EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lm_eval_expected_smollm2.json")
# Per log-likelihood, in nats. Both sides are float32 on CPU but not the same arithmetic: linjax's export
# holds weights dequantised from the GGUF by linjax (JAX) and saved as safetensors, the reference
# transformers' own dequantisation of the same file; the export scores each context once and its
# continuations from the decode cache (SharedPrefixHFLM), HFLM whole padded rows. Sums of up to 36 float32
# log-probs (PIQA's long continuations reach -110 nats) differed by at most 4.6e-5 nats over the fixture's 79
# log-likelihoods; scaling every score by 1.001 moves PIQA's by 0.11 nats, and a changed token in a prompt or
# target by far more than the tolerance.
LOGLIKELIHOOD_ATOL = 2e-3


@pytest.mark.slow
def test_smollm2_scores_match_transformers_hflm(shared_data, tmp_path):
    """`linjax eval lm-eval smollm2-135m` (linjax's GGUF conversion, export, SharedPrefixHFLM) gives, document
    by document, the scores committed in tests/fixtures/lm_eval_expected_smollm2.json: lm-eval's stock HFLM on
    the model transformers loads from the same GGUF, on the first documents of every local task. The same
    requests (hashes of each context and continuation: a changed prompt, target or data file fails), the same
    chosen answers, greedy flags and per-document metrics, the log-likelihoods within LOGLIKELIHOOD_ATOL."""
    require_embedded_model()
    with open(EXPECTED) as f:
        expected = json.load(f)
    rerun = "(an intended change? rerun tests/fixtures/make_lm_eval_expected.py and commit its JSON)"
    data = _full_data_dir(str(tmp_path / "data"), shared_data)
    out = str(tmp_path / "out")
    result = lm_eval_bridge.run("smollm2-135m", tasks=expected["tasks"], data_dir=data, limit=expected["limit"],
                                batch_size=4, out_dir=out, samples=True)
    assert result["num_fewshot"] == expected["num_fewshot"]
    worst = 0.0
    for task in expected["tasks"]:
        with open(os.path.join(out, f"samples_{task}.jsonl")) as f:
            ours = [json.loads(line) for line in f]
        theirs = expected["samples"][task]
        assert [r["doc_id"] for r in ours] == [r["doc_id"] for r in theirs], task
        for a, b in zip(ours, theirs):
            where = f"{task} document {b['doc_id']}"
            for key in ("doc_hash", "target", "continuations", "requests"):
                assert a[key] == b[key], f"{where}: {key} differs {rerun}"
            diffs = [abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)]
            worst = max(worst, *diffs)
            assert max(diffs) <= LOGLIKELIHOOD_ATOL, (where, a["loglikelihoods"], b["loglikelihoods"])
            assert a["chosen"] == b["chosen"] and a["is_greedy"] == b["is_greedy"], where
            for metric in ("acc", "acc_norm"):
                assert a["metrics"].get(metric) == b["metrics"].get(metric), (where, metric)
    print(f"largest log-likelihood difference: {worst:.2e} nats")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["linearized and trained"])
def test_smollm2_local_tasks(variant, shared_data, tmp_path):
    """The paper's tasks from the local files on the real model linearized (GDN + w56 + s8 + short conv) with its
    new parameters trained for two steps, through `linjax export`'s PyTorch module. (The original model's
    scores are pinned by test_smollm2_scores_match_transformers_hflm.)"""
    require_embedded_model()
    model = "smollm2-135m"
    if variant != "original":
        from linjax import train
        from linjax.experiment import from_dict

        model = str(tmp_path / "run")
        train.run(from_dict({"run_dir": model, "model": {"source": "smollm2-135m"},
                             "linearize": {"mechanism": "gdn", "window": 56, "sinks": 8, "adapter": "shortconv"},
                             "data": {"paths": [os.path.join(shared_data, "webtext")]},
                             "train": {"steps": 2, "seq_len": 64, "batch_size": 1, "warmup_steps": 1,
                                       "checkpoint_every": 2}}), progress=False)
    tasks = ["piqa", "arc_easy", "hellaswag", "mmlu_abstract_algebra", "lambada_openai"]
    result = lm_eval_bridge.run(model, tasks=tasks, data_dir=shared_data, limit=3, batch_size=4,
                                out_dir=str(tmp_path / "out"))
    r = result["results"]
    assert result["num_fewshot"]["mmlu_abstract_algebra"] == 5
    for task in tasks:
        assert 0 <= r[task]["acc,none"] <= 1
        assert result["n-samples"][task]["effective"] == 3
    # A trained 135M model, not a random one (a uniform guess over 49,152 tokens scores ~49,152).
    assert 1 < r["lambada_openai"]["perplexity,none"] < 2000


@pytest.fixture(scope="module")
def tiny_linearized(tmp_path_factory, tokenizer):
    """A tiny LLaMA linearized with GDN + window 8 + 2 sinks + short conv (contexts cross into the linear state)."""
    from flax import nnx

    import linjax
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    base = CausalLM(tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                max_position_embeddings=96), rngs=nnx.Rngs(1))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=8, sinks=2, adapter="shortconv"))
    return linjax.save_hf(model, str(tmp_path_factory.mktemp("tiny-gdn") / "model"), tokenizer)


def _prefix_sharing_requests(vocab: int, max_length: int):
    """Contexts that share prefixes of several lengths (one a prefix of another, one repeated with other
    continuations), single- and multi-token continuations, and one request longer than the model takes."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = lambda n: [int(t) for t in rng.integers(1, vocab, n)]  # noqa: E731
    shots = tokens(40)  # a few-shot prefix
    question = tokens(6)
    contexts = [shots + question, shots + question[:3] + tokens(5), shots[:20], tokens(30), shots + question]
    contexts += [shots + tokens(8) for _ in range(4)]  # as MMLU: one prefix, then different questions
    requests = [(("", ""), ctx, cont) for ctx in contexts for cont in (tokens(1), tokens(3), tokens(1), tokens(5))]
    requests.append((("", ""), tokens(max_length), tokens(4)))  # HFLM truncates it from the left
    return requests


@pytest.mark.parametrize("which,min_shared", [("plain", 16), ("plain", 1), ("linearized", 16), ("linearized", 1)])
def test_shared_prefixes_give_hflm_loglikelihoods(which, min_shared, tiny_source, tiny_linearized):
    """SharedPrefixHFLM scores every request as lm-eval's HFLM does (sum of log-probs within 1e-4, the same
    greedy flags), for the standard architecture and for an exported linearized model with its LinjaxCache."""
    from lm_eval.models.huggingface import HFLM

    from linjax.eval.shared_prefix_lm import SharedPrefixHFLM

    directory = tiny_source if which == "plain" else tiny_linearized
    lm = SharedPrefixHFLM(pretrained=directory, trust_remote_code=True, device="cpu", dtype="float32",
                          batch_size=4, max_length=96)
    lm.min_shared_tokens = min_shared  # 1: a snapshot wherever two neighbouring contexts share a token
    requests = _prefix_sharing_requests(lm.tokenizer.vocab_size, lm.max_length)
    shared = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    reference = HFLM._loglikelihood_tokens(lm, requests, disable_tqdm=True)
    assert len(shared) == len(reference) == len(requests)
    for i, ((ours, our_greedy), (theirs, their_greedy)) in enumerate(zip(shared, reference)):
        assert abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs)), (i, ours, theirs)
        assert our_greedy == their_greedy, i
    assert len({round(s, 3) for s, _ in shared}) > len(requests) // 2  # distinct scores: not all one value


def test_resume_keeps_finished_tasks_and_refuses_other_settings(tiny_source, shared_data, tmp_path):
    out = str(tmp_path / "out")
    first = lm_eval_bridge.run(tiny_source, tasks=["piqa"], data_dir=shared_data, limit=2, out_dir=out)
    result = lm_eval_bridge.run(tiny_source, tasks=["piqa", "arc_easy"], data_dir=shared_data, limit=2,
                                out_dir=out, resume=True)
    assert result["results"]["piqa"] == first["results"]["piqa"]
    assert result["seconds_per_task"]["piqa"] == first["seconds_per_task"]["piqa"]  # not run again
    assert result["finished_tasks"] == ["piqa", "arc_easy"] and "arc_easy" in result["results"]
    again = lm_eval_bridge.run(tiny_source, tasks=["arc_easy"], data_dir=shared_data, limit=2, out_dir=out,
                               resume=True)  # another task list: what the others finished stays
    assert again["seconds_per_task"] == result["seconds_per_task"] and again["results"] == result["results"]
    with pytest.raises(ValueError, match="same settings"):
        lm_eval_bridge.run(tiny_source, tasks=["piqa"], data_dir=shared_data, limit=3, out_dir=out, resume=True)


def test_resume_refuses_a_model_retrained_in_place(tiny_source, shared_data, tmp_path):
    """Finished tasks and cached request scores belong to the weights, not to the path: a model
    retrained at the same path must not inherit them."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_source, model)
    (model / ".linjax-export").unlink()  # retrained by other means: not linjax's record of what it wrote
    out = str(tmp_path / "out")
    lm_eval_bridge.run(str(model), tasks=["piqa"], data_dir=shared_data, limit=2, out_dir=out)
    weights = str(model / "model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.1  # "retrained": other weights, same path and settings
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="other weights"):
        lm_eval_bridge.run(str(model), tasks=["piqa", "arc_easy"], data_dir=shared_data, limit=2, out_dir=out,
                           resume=True)


def test_resume_inside_a_task_rescores_only_what_was_not_scored(tiny_source, shared_data, tmp_path, monkeypatch):
    """A run killed halfway through a task keeps the requests it scored (lm-eval's sqlite request cache);
    --resume scores only the rest and gets the uninterrupted run's numbers."""
    from linjax.eval.shared_prefix_lm import SharedPrefixHFLM

    reference = lm_eval_bridge.run(tiny_source, tasks=["arc_easy"], data_dir=shared_data, limit=6,
                                   out_dir=str(tmp_path / "reference"))
    assert not [f for f in os.listdir(tmp_path / "reference") if f.endswith(".db")]  # finished: cache removed
    score = SharedPrefixHFLM._score_continuations
    calls = []

    def killed_after_three(self, *args):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return score(self, *args)

    out = str(tmp_path / "out")
    monkeypatch.setattr(SharedPrefixHFLM, "_score_continuations", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        lm_eval_bridge.run(tiny_source, tasks=["arc_easy"], data_dir=shared_data, limit=6, out_dir=out)
    calls.clear()
    monkeypatch.setattr(SharedPrefixHFLM, "_score_continuations",
                        lambda self, *args: calls.append(1) or score(self, *args))
    result = lm_eval_bridge.run(tiny_source, tasks=["arc_easy"], data_dir=shared_data, limit=6, out_dir=out,
                                resume=True)
    assert len(calls) == 3  # 6 questions, 3 scored before the kill
    assert result["results"]["arc_easy"] == reference["results"]["arc_easy"]


def test_cli_log_samples_asks_for_per_example_results(monkeypatch, tmp_path):
    """`linjax eval lm-eval --log-samples` (the claims rows' LAMBADA on all 5,153) writes samples_<task>.jsonl."""
    from linjax.app import eval_cli
    from linjax.app.cli import main

    asked = []
    monkeypatch.setattr(eval_cli.lm_eval_bridge, "run",
                        lambda model, **options: asked.append(options) or {"table_markdown": "", "seconds": 0.0})
    for flags in ([], ["--log-samples"]):
        main(["eval", "lm-eval", "smollm2-135m", "--tasks", "lambada_openai", "--out", str(tmp_path / str(len(flags))),
              *flags])
    assert [options["samples"] for options in asked] == [False, True]
