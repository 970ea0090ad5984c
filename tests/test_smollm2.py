"""The embedded default model, SmolLM2-135M-Instruct (GGUF), against transformers' own GGUF loading."""

import jax.numpy as jnp
import numpy as np
import pytest

import linjax
from linjax.generate import generate
from tests.helpers import require_embedded_model, require_module

require_module("torch")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def both_models():
    import os

    from transformers import AutoModelForCausalLM

    path = require_embedded_model()
    ours, tokenizer = linjax.load("smollm2-135m")
    theirs = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype="float32", attn_implementation="eager").eval()
    return ours, theirs, tokenizer


def test_logits_match_transformers_gguf_loading(both_models):
    import torch

    ours, theirs, tokenizer = both_models
    text = open(__file__).read()
    ids = tokenizer(text)["input_ids"][:64]
    assert len(ids) == 64
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits.numpy()
    got = np.asarray(ours(jnp.asarray([ids], jnp.int32)))
    assert np.max(np.abs(got - expected)) <= 1e-3


def test_greedy_continuation_matches_transformers(both_models):
    import torch

    ours, theirs, tokenizer = both_models
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
    got = generate(ours, jnp.asarray([ids], jnp.int32), 10)[0, len(ids):]
    assert np.asarray(got).tolist() == expected.tolist()
    assert "Berlin" in tokenizer.decode(np.asarray(got))


def test_torch_free_gguf_tokenizer_equals_transformers(both_models, shared_data):
    import os

    from transformers import AutoTokenizer

    from linjax.convert.gguf import load_gguf_tokenizer
    from linjax.convert.sources import embedded_gguf_path

    path = embedded_gguf_path()
    ours = load_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = open(os.path.join(shared_data, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw")).read()[:20000]
    text += " 12345 <|im_start|>user\nhi<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert (ours.eos_token, ours.bos_token, ours.chat_template) == (theirs.eos_token, theirs.bos_token,
                                                                    theirs.chat_template)


def test_linearized_smollm2_is_finite_at_2048_and_generates(both_models, shared_data):
    import os

    ours, _, tokenizer = both_models
    config = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv")
    model = linjax.linearize(ours, config)
    text = open(os.path.join(shared_data, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw")).read()
    ids = tokenizer(text[:20000])["input_ids"][:2048]
    assert len(ids) == 2048
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray([ids], jnp.int32))
    assert logits.shape == (1, 2048, model.config.vocab_size) and bool(jnp.isfinite(logits).all())
    out = linjax.generate(model, jnp.asarray([ids[:100]], jnp.int32), 5)
    assert out.shape == (1, 105)
