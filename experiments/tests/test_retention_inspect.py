"""experiments/retention_inspect.py: finding a needle's tokens, reading the retained slots, summing a cell up."""

from types import SimpleNamespace

import numpy as np
import pytest

from experiments.tests.helpers import experiment_script


@pytest.fixture(scope="module")
def inspect_module():
    return experiment_script("retention_inspect.py")


def test_token_span_finds_the_needle_and_its_value(inspect_module, tokenizer):
    needle = "One of the special magic numbers for quiet-river is: 5885392."
    prompt = "The grass is green. 5885392 appears early. " + needle + " The sky is blue. What is it?"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    first, end = inspect_module.token_span(tokenizer, prompt, needle)
    assert tokenizer.decode(ids[first:end]).strip() == needle
    # the value searched from the needle on: not the earlier copy of the same number
    v_first, v_end = inspect_module.token_span(tokenizer, prompt, "5885392", prompt.index(needle))
    assert first < v_first < v_end < end
    assert tokenizer.decode(ids[v_first:v_end]).strip() == "5885392"


def retained_state(positions):
    """A layer's state whose retained slots hold `positions` [R, Hkv] (−1: empty)."""
    retained = SimpleNamespace(position=np.asarray(positions)[None])
    return SimpleNamespace(window=SimpleNamespace(retained=retained))


def test_held_share_counts_every_layer_and_kv_head_cache(inspect_module):
    states = [retained_state([[5, 7], [6, -1]]),  # layer 0: head 0 holds 5 and 6, head 1 holds 7
              retained_state([[5, 5], [9, 6]]),  # layer 1: head 0 holds 5 and 9, head 1 holds 5 and 6
              SimpleNamespace(window=None)]  # a layer without slots (full attention, say) is not counted
    assert len(inspect_module.retained_slots(states)) == 4
    assert inspect_module.held_share(states, [5, 6, 7, 8]) == {5: 0.75, 6: 0.5, 7: 0.25, 8: 0.0}


def test_summary_averages_the_prompts_and_ranks_the_held_tokens(inspect_module):
    def row(i, correct, trace, held):
        return {"sample": i, "depth": i / 2, "answer": "1", "prediction": "1" if correct else "2", "correct": correct,
                "value_held_while_reading": [{"tokens_read": 16 * (k + 1), "value_held": v}
                                             for k, v in enumerate(trace)],
                "held_tokens_at_end": held}

    result = inspect_module.summary([row(0, True, [0.8, 0.6], {".": 3, " the": 1}),
                                     row(1, False, [0.2, 0.0], {".": 4})])
    assert result["accuracy"] == 0.5
    assert result["value_held_peak_mean"] == pytest.approx(0.5)
    assert result["value_held_at_end_mean"] == pytest.approx(0.3)
    assert result["most_held_tokens"][0] == {"token": ".", "share_of_slots": 0.875}
    assert [p["value_held_at_end"] for p in result["prompts"]] == [0.6, 0.0]


@pytest.mark.parametrize("argv, message", [
    (["all", "--force-needle"], "--force-needle takes one SAMPLE"),
    (["20"], "sample must be 0-19"),
    (["first"], "sample must be 0-19"),
])
def test_bad_arguments_get_one_line(inspect_module, argv, message):
    with pytest.raises(SystemExit, match=message):
        inspect_module.main(argv)


@pytest.mark.parametrize("form", ["admit", "select"])
def test_forcing_keeps_the_span_whatever_its_score(inspect_module, monkeypatch, form):
    import jax.numpy as jnp

    from linjax.kernels import retention

    for name in ("admit", "select"):  # force_span patches the module; put it back after the test
        monkeypatch.setattr(retention, name, getattr(retention, name))
    entries = (jnp.zeros((1, 1, 4)),)  # one array per token [B, Hkv, D]
    cache = retention.empty(1, 1, 1, entries)
    cache = cache._replace(score=jnp.full((1, 1, 1), 5.0), position=jnp.full((1, 1, 1), 3, jnp.int32))
    low, position = jnp.full((1, 1, 1), 0.1), jnp.full((1, 1), 10, jnp.int32)
    valid = jnp.ones((1, 1, 1), bool)
    offer = lambda: (retention.admit(cache, entries, low[:, 0], position[:, 0], valid[:, 0]) if form == "admit"
                     else retention.select(cache, (entries[0][:, None],), low, position, valid))
    assert int(offer()[0].position[0, 0, 0]) == 3  # a score of 0.1 does not take the slot held at 5
    inspect_module.force_span(10, 11)
    assert int(offer()[0].position[0, 0, 0]) == 10  # forced in
