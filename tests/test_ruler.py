"""RULER generators: needles, chains and word lists as intended, the requested length, string-match scoring."""

import collections
import json
import re

import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.app.cli import main
from linjax.eval import ruler
from linjax.linearize import with_budget
from tests.helpers import stopping_at_call


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    """A small essay-like haystack, so the tests do not need the data folder."""
    rng = np.random.default_rng(0)
    words = ["startups", "grow", "when", "founders", "write", "code", "and", "talk", "to", "users", "every", "week"]
    text = " ".join(" ".join(rng.choice(words, 9)).capitalize() + "." for _ in range(400))
    path = tmp_path_factory.mktemp("hay") / "essays.json"
    path.write_text(json.dumps({"text": text}))
    return str(path)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3"])
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
        end = s.prompt.index("\nWhat is the special magic")
        where = (s.prompt.index(s.needle, start) - start) / (end - start - len(s.needle))
        assert abs(where - depth) < 0.06, (where, depth)
    value = s.answers[0]
    if task == "niah_single_3":  # a UUID
        assert len(value) == 36 and value.count("-") == 4
    else:
        assert len(value) == 7 and value.isdigit()


def test_scoring():
    assert ruler.score(" 1234567.", ["1234567"]) == 1.0
    assert ruler.score("The number is 7654321", ["1234567"]) == 0.0
    assert ruler.score("ABCDEF-12", ["abcdef-12"]) == 1.0
    assert ruler.score("first 11 and 22", ["11", "33"]) == 0.5


def test_bad_requests_are_clear_errors(tokenizer):
    generator = ruler.Generator(tokenizer, None)
    with pytest.raises(ValueError, match="unknown task 'niah_double'; choose from niah_single_1, .*, vt, cwe, fwe"):
        generator.sample("niah_double", 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot hold"):
        generator.sample("niah_single_1", 20, np.random.default_rng(0))
    for task, length in [("vt", 200), ("cwe", 512), ("fwe", 200), ("multikey_3", 60)]:
        with pytest.raises(ValueError, match=f"{length} tokens cannot hold even the smallest {task} prompt"):
            generator.sample(task, length, np.random.default_rng(0))
    with pytest.raises(ValueError, match="depth= places the needle of niah_single"):
        generator.sample("multikey", 512, np.random.default_rng(0), depth=0.5)
    with pytest.raises(ValueError, match="unknown RULER task.*multi_key"):
        ruler.run("no-such-model", tasks=["vt", "multi_key"], lengths=[512], samples=1, out="unused.json")


EXTENDED = ["multikey", "multikey_2", "multikey_3", "multivalue", "multiquery", "vt", "cwe", "fwe"]
NEEDLE = re.compile(r"^One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.$")


@pytest.mark.parametrize("task", EXTENDED)
@pytest.mark.parametrize("size", ["short", "long"])
def test_extended_tasks(task, size, tokenizer, haystack):
    """Each task at two lengths (cwe: both of RULER's settings): the prompt fits, what was inserted is there
    as intended, and the answer key scores 1 while a partial answer scores less."""
    length = {"short": 512, "long": 1024}[size] if task != "cwe" else {"short": 1024, "long": 4096}[size]
    s = ruler.Generator(tokenizer, haystack).sample(task, length, np.random.default_rng(7))
    tokens = len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"])
    # multikey_2/3 grow by whole distractor lines, so may fall short by one line.
    slack = max(0.02 * length, 2 + len(tokenizer(s.needle)["input_ids"]) if task in ("multikey_2", "multikey_3") else 0)
    assert length - slack <= tokens <= length, (tokens, length)
    assert s.max_new_tokens == ruler.NEW_TOKENS[task]
    assert ruler.score(" and ".join(s.answers), s.answers) == 1.0
    assert ruler.score(" and ".join(s.answers[1:]) + " 0000000 ZZZZZ", s.answers) < 1.0
    assert len(set(s.answers)) == len(s.answers)
    question = s.prompt[s.prompt.rindex("\n"):]
    if task in ("vt", "cwe", "fwe"):
        return {"vt": _check_vt, "cwe": _check_cwe, "fwe": _check_fwe}[task](s, length, question)

    # Needle tasks: each needle once, in order of depth; each value once in the whole prompt.
    positions = [s.prompt.index(n) for n in s.needles]
    assert all(s.prompt.count(n) == 1 for n in s.needles) and positions == sorted(positions)
    assert list(s.depths) == sorted(s.depths)
    assert all(s.prompt.count(a) == 1 for a in s.answers)
    parsed = [NEEDLE.match(n).groups() for n in s.needles]
    keys = [key for _, key, _ in parsed]
    value_of = {value: key for _, key, value in parsed}
    asked = [value_of[a] for a in s.answers]
    if task == "multivalue":
        assert len(s.needles) == 4 and len(set(keys)) == 1 and set(value_of) == set(s.answers)
        assert f"What are all the special magic numbers for {keys[0]} mentioned" in question
    elif task == "multiquery":
        assert len(s.needles) == 4 and len(set(keys)) == 4 and len(s.answers) == 4
        assert f"numbers for {asked[0]}, {asked[1]}, {asked[2]}, and {asked[3]} mentioned" in question
    else:
        asking = f"What is the special magic {parsed[0][0][:-1]} for {asked[0]} mentioned"
        assert len(s.answers) == 1 and asking in question
        assert len(s.needles) == (4 if task == "multikey" else 1) and len(set(keys)) == len(keys)
    if task in ("multikey_2", "multikey_3"):  # the haystack is made of needles with other keys
        lines = s.prompt[s.prompt.index("afterwards.\n") + 12:s.prompt.rindex("\nWhat is")].split("\n")
        others = [NEEDLE.match(line).group(2) for line in lines if line != s.needle]
        assert len(others) == len(lines) - 1 >= 3 and asked[0] not in others
        if task == "multikey_3":
            assert all(len(k) == 36 and k.count("-") == 4 for k in others + asked + list(s.answers))


def _check_vt(s, length, question):
    value = s.needles[0].split(" = ")[1]
    assert s.needles == (f"VAR {s.answers[0]} = {value}",) + tuple(
        f"VAR {b} = VAR {a}" for a, b in zip(s.answers, s.answers[1:]))
    assert all(len(name) == 5 and name.isupper() for name in s.answers) and len(value) == 5
    task = s.prompt[s.prompt.rindex("Memorize and track"):]  # after the worked example
    lines = task.split("\n")
    at = [lines.index(statement) for statement in s.needles]  # each a line of its own, hop by hop
    assert at == sorted(at) and all(lines.count(statement) == 1 for statement in s.needles)
    assert all(s.prompt.count(name) == (1 if i == 4 else 2) for i, name in enumerate(s.answers))
    assert question.endswith(f"5 variables are assigned the value {value}, they are: ")
    assert "they are: " in s.prompt[:s.prompt.rindex("Memorize and track")]  # the example shows an answer


def _check_cwe(s, length, question):
    listed = s.prompt[s.prompt.rindex("most often.\n") + 12:s.prompt.rindex("\nQuestion:")]
    assert listed == " ".join(f"{i + 1}. {w}" for i, w in enumerate(s.words))
    counts = collections.Counter(s.words)
    often, rarely = (30, 3) if length >= 4096 else (6, 1)
    assert len(s.answers) == 10 and all(counts[a] == often for a in s.answers)
    assert {c for w, c in counts.items() if w not in s.answers} == {rarely} and len(counts) > 20
    assert question.endswith("The top 10 words that appear most often in the list are:")


def _check_fwe(s, length, question):
    assert s.prompt.count(" ".join(s.words)) == 1
    ranked = collections.Counter(s.words).most_common()
    assert ranked[0][0] == "..." and tuple(w for w, _ in ranked[1:4]) == s.answers
    assert ranked[3][1] > ranked[4][1] > 0  # the third answer beats every other word
    assert all(len(a) == 6 and a.isalpha() for a in s.answers)


def test_cwe_words_do_not_contain_one_another():
    from linjax.eval.ruler_words import WORDS

    assert len(set(WORDS)) == len(WORDS) > 1000
    joined = " ".join(WORDS)
    assert all(joined.count(w) == 1 for w in WORDS)  # no word inside another


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


def test_a_stopped_run_resumes_from_its_last_sample(tiny_source, haystack, tmp_path, monkeypatch):
    """The file is written after every sample (marked incomplete); `--resume` scores only the samples
    it lacks and ends with the results of an unbroken run; other settings are refused."""
    args = ["eval", "ruler", tiny_source, "--tasks", "niah_single_1", "--lengths", "160,200", "--samples", "2",
            "--haystack", haystack]
    whole = tmp_path / "whole.json"
    main(args + ["--out", str(whole)])
    calls, real_generate = [], ruler.generate
    monkeypatch.setattr(ruler, "generate", stopping_at_call(3, real_generate, calls))
    out = tmp_path / "ruler.json"
    with pytest.raises(KeyboardInterrupt):
        main(args + ["--out", str(out)])
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and len(partial["samples"]) == 2 and len(partial["results"]) == 1
    with pytest.raises(SystemExit):  # an existing --out without --resume or --overwrite: refused
        main(args + ["--out", str(out)])
    calls.clear()
    monkeypatch.setattr(ruler, "generate", lambda *a, **k: (calls.append(1), real_generate(*a, **k))[1])
    main(args + ["--out", str(out), "--resume"])
    assert len(calls) == 2  # the second length's two samples only
    resumed, expected = json.loads(out.read_text()), json.loads(whole.read_text())
    assert resumed["complete"] is True
    assert (resumed["results"], resumed["samples"]) == (expected["results"], expected["samples"])
    with pytest.raises(SystemExit):  # other settings than the file's
        main(args[:-4] + ["--samples", "3", "--haystack", haystack, "--out", str(out), "--resume"])


def test_cli_extended_tasks(tiny_source, haystack, tmp_path):
    out = tmp_path / "extended.json"
    main(["eval", "ruler", tiny_source, "--tasks", "multikey,vt", "--lengths", "500", "--samples", "1",
          "--haystack", haystack, "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["task"], r["length"], r["samples"]) for r in result["results"]] == [("multikey", 500, 1), ("vt", 500, 1)]
    assert [len(r["answers"]) for r in result["samples"]] == [1, 5]
    assert "| vt | 500 |" in (tmp_path / "extended.md").read_text()


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
    retaining = budget_variants(model, [128], 8, retain=64)
    (label, variant), = retaining.items()
    assert label == "budget 128 (sinks 8, window 56, retained 64 by recall)"
    assert (variant.linearize_config.window, variant.linearize_config.retain) == (56, 64)
    assert budget_variants(model, [128], 8)["budget 128 (sinks 8, window 120)"].linearize_config.retain == 0
    with pytest.raises(ValueError, match="--retain keeps tokens"):
        budget_variants(base, [128], 8, window_only=True, retain=64)
    with pytest.raises(ValueError, match=r"exceed --sinks \+ --retain"):
        budget_variants(model, [72], 8, retain=64)


@pytest.mark.parametrize("mechanism,prompt_len", [("softmax", 37), ("gdn", 37), ("gdn", 47)])
def test_fixed_shape_prefill_generates_the_same_tokens(mechanism, prompt_len):
    """generate(prefill_chunk=..., cache_length=...) (the S-NIAH path) equals one-shot prefill."""
    from linjax.config import tiny_config
    from linjax.generate import generate
    from linjax.model import CausalLM

    model = CausalLM(tiny_config("qwen3", num_hidden_layers=2), rngs=nnx.Rngs(3))
    if mechanism != "softmax":
        model = linjax.linearize(model, linjax.LinearizeConfig(mechanism=mechanism, window=6, sinks=2,
                                                               adapter="shortconv"))
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, prompt_len)).astype(np.int32)
    expected = np.asarray(generate(model, prompt, 8))
    got = np.asarray(generate(model, prompt, 8, prefill_chunk=16, cache_length=64))
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match=f"cache_length {prompt_len + 3} is too small"):
        generate(model, prompt, 8, cache_length=prompt_len + 3)
