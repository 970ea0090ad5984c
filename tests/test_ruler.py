"""S-NIAH generators: the needle once at its depth, the requested length, and string-match scoring."""

import json

import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.cli import main
from linjax.eval import ruler
from linjax.linearize import with_budget


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    """A small essay-like haystack, so the tests do not need the data folder."""
    rng = np.random.default_rng(0)
    words = ["startups", "grow", "when", "founders", "write", "code", "and", "talk", "to", "users", "every", "week"]
    text = " ".join(" ".join(rng.choice(words, 9)).capitalize() + "." for _ in range(400))
    path = tmp_path_factory.mktemp("hay") / "essays.json"
    path.write_text(json.dumps({"text": text}))
    return str(path)


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("length", [256, 1024])
def test_needle_once_at_its_depth_and_the_prompt_fits(task, length, tokenizer, haystack):
    generator = ruler.Generator(tokenizer, haystack)
    rng = np.random.default_rng(1)
    for depth in (0.0, 0.5, 1.0):
        s = generator.sample(task, length, rng, depth=depth)
        tokens = len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"])
        assert abs(tokens - length) <= 0.02 * length, (tokens, length)
        assert s.prompt.count(s.needle) == 1 and s.prompt.count(s.answers[0]) == 1
        start = s.prompt.index("afterwards.\n") + len("afterwards.\n")
        end = s.prompt.index("\nWhat are all the special magic")
        where = (s.prompt.index(s.needle, start) - start) / (end - start - len(s.needle))
        assert abs(where - depth) < 0.06, (where, depth)
    value = s.answers[0]
    assert (len(value) == 36 and value.count("-") == 4) if task == "niah_single_3" else (len(value) == 7 and value.isdigit())


def test_scoring():
    assert ruler.score(" 1234567.", ["1234567"]) == 1.0
    assert ruler.score("The number is 7654321", ["1234567"]) == 0.0
    assert ruler.score("ABCDEF-12", ["abcdef-12"]) == 1.0
    assert ruler.score("first 11 and 22", ["11", "33"]) == 0.5


def test_bad_requests_are_clear_errors(tokenizer):
    generator = ruler.Generator(tokenizer, None)
    with pytest.raises(ValueError, match="unknown task"):
        generator.sample("niah_double", 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot hold"):
        generator.sample("niah_single_1", 20, np.random.default_rng(0))


def test_with_budget_changes_the_window_not_the_parameters():
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    base = CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=4, sinks=2), seed=0)
    wider = with_budget(model, sinks=2, window=30)
    assert wider.linearize_config.window == 30 and model.linearize_config.window == 4
    for a, b in zip(*(nnx.state(m, nnx.Param).flat_state() for m in (model, wider))):
        assert a[0] == b[0] and np.array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]))
    tokens = np.arange(24, dtype=np.int32)[None] % base.config.vocab_size
    assert not np.allclose(np.asarray(model(tokens)), np.asarray(wider(tokens)))
    # A window over the whole sequence without sinks: the linear state is still empty, so the
    # model is the original full-attention one.
    whole = with_budget(model, sinks=0, window=32)
    np.testing.assert_allclose(np.asarray(whole(tokens)), np.asarray(base(tokens)), atol=1e-5)
    with pytest.raises(ValueError, match="already|linearized"):
        with_budget(base, sinks=0, window=8)


def test_cli_on_a_tiny_model(tiny_source, haystack, tmp_path):
    out = tmp_path / "ruler.json"
    main(["eval", "ruler", tiny_source, "--tasks", "niah_single_1,niah_single_2", "--lengths", "160",
          "--samples", "2", "--haystack", haystack, "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["task"], r["length"], r["samples"]) for r in result["results"]] == [
        ("niah_single_1", 160, 2), ("niah_single_2", 160, 2)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in result["results"])
    assert (tmp_path / "ruler.md").exists()


def test_cli_window_only_baseline(tiny_source, haystack, tmp_path):
    out = tmp_path / "window.json"
    main(["eval", "ruler", tiny_source, "--tasks", "niah_single_1", "--lengths", "160", "--samples", "2",
          "--budgets", "16,40", "--sinks", "4", "--window-only", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["results"]] == ["window only, budget 16 (sinks 4, window 12)",
                                                         "window only, budget 40 (sinks 4, window 36)"]
    assert result["settings"]["window_only"] and result["settings"]["budgets"] == [16, 40]


def test_budget_variants_and_their_errors():
    from linjax.config import tiny_config
    from linjax.eval.ruler import budget_variants
    from linjax.linearize import mixer_names
    from linjax.model import CausalLM

    base = CausalLM(tiny_config("llama", num_hidden_layers=2), rngs=nnx.Rngs(0))
    assert list(budget_variants(base, None, 8)) == ["full attention"]
    window = budget_variants(base, [128], 8, window_only=True)["window only, budget 128 (sinks 8, window 120)"]
    assert mixer_names(window) == ["window", "window"] and window.linearize_config.window == 120
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=4, sinks=2))
    assert budget_variants(model, [64], 8)["budget 64 (sinks 8, window 56)"].linearize_config.sinks == 8
    with pytest.raises(ValueError, match="--window-only"):
        budget_variants(base, [128], 8)
    with pytest.raises(ValueError, match="plain"):
        budget_variants(model, [128], 8, window_only=True)
    with pytest.raises(ValueError, match="exceed --sinks"):
        budget_variants(model, [8], 8)


@pytest.mark.parametrize("mechanism", ["softmax", "gdn"])
def test_fixed_shape_prefill_generates_the_same_tokens(mechanism):
    """generate(prefill_chunk=..., cache_length=...) (the S-NIAH path) equals one-shot prefill."""
    from linjax.config import tiny_config
    from linjax.generate import generate
    from linjax.model import CausalLM

    model = CausalLM(tiny_config("qwen3", num_hidden_layers=2), rngs=nnx.Rngs(3))
    if mechanism != "softmax":
        model = linjax.linearize(model, linjax.LinearizeConfig(mechanism=mechanism, window=6, sinks=2,
                                                               adapter="shortconv"))
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 37)).astype(np.int32)
    expected = np.asarray(generate(model, prompt, 8))
    got = np.asarray(generate(model, prompt, 8, prefill_chunk=16, cache_length=64))
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="cache_length 40 is too small"):
        generate(model, prompt, 8, cache_length=40)
