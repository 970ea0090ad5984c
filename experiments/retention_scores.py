"""Which retention score tells an S-NIAH needle from its haystack: candidate scores screened.

    python experiments/retention_scores.py [--task niah2] [--length 2048] [--prompts 8] [--run final|trained]

Reads the first prompts of a grid cell (experiments/retention.py: seed 0, the cell's prompts in order) with
the run's sinks 8 + window 56 and no retained slots, its linear state taking every token that leaves
the window, and scores every token that leaves it with each candidate, per layer and kv head:

    recall      LoLA's self-recall error ‖v − Sᵀk‖ / ‖v‖ against the state as the token enters it
                (the default score, `kernels/retention.py`; here scored once, as the token leaves)
    key_norm    ‖k‖ of the pretrained key (the cheap score)
    value_norm  ‖v‖ of the pretrained value
    attention   the softmax attention mass the token received from the queries while it was in the
                window, over the kv head's query heads (H2O's score: what the model looked at)
    surprisal   the run's negative log-likelihood of the token (one value for every cache)

For each cache: the AUC of the needle's value tokens (the number, or the UUID) against every other
token that leaves the window, and the share of them among the 64 highest scores, which a score fixed
when the token leaves would keep with 64 slots (recall is re-scored at every step in linjax, so for it
this share is only indicative). Writes results/retention/scores-<run>-<task>-<length>.json.

A screen, not a retention policy: it shows which signal separates needles from prose before one is
built into every path (decode, blocks, export).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from linjax.eval.models import load_model
from linjax.eval.ruler_tasks import TASKS, Generator
from linjax.files import write_json
from linjax.kernels import gdn, retention
from linjax.linearize import with_budget

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")
sys.path.insert(0, HERE)  # the inspection script beside this one: the same cells, runs and needle spans
from retention_inspect import CELL_TASKS, RUNS, SEED, SINKS, WINDOW, token_span  # noqa: E402

SLOTS = 64  # the retained tokens of the 128-token budget
SCORES = ("recall", "key_norm", "value_norm", "attention", "surprisal")


@jax.jit
def recall_as_leaving(k, v, log_alpha, beta):
    """Each token's recall error against the state holding every earlier non-sink token, the token's own
    decay applied first (as it is scored when it leaves the window). k, v [T, Hkv, D]; log_alpha
    [T, H, Dk]; beta [T, H] -> [T, Hkv]."""
    H = beta.shape[-1]
    state = jnp.zeros((1, H, k.shape[-1], v.shape[-1]), jnp.float32)

    def one(state, token):
        tk, tv, ta, tb = (a[None] for a in token)
        error = retention.recall_error(state, tk[:, None], tv[:, None], ta)[0, 0]
        _, state = gdn.step(jnp.zeros((1, H, tk.shape[-1]), jnp.float32), tk, tv, ta, tb, state=state)
        return state, error

    return jax.lax.scan(one, state, (k, v, log_alpha, beta))[1]


def window_attention_mass(q, k):
    """The attention each token receives from the queries whose sinks + window hold it, summed over those
    queries and averaged over the kv head's query heads. q [T, H, D], k [T, Hkv, D] -> [T, Hkv]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    kh = jnp.repeat(k, H // Hkv, axis=1)
    scores = jnp.einsum("ihd,jhd->hij", q.astype(jnp.float32), kh.astype(jnp.float32)) / np.sqrt(D)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((j < SINKS) | (j > i - WINDOW))
    p = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
    received = p.sum(axis=1)  # [H, T]
    return received.reshape(Hkv, H // Hkv, T).mean(1).T


def layer_scores(mixer, h, positions) -> dict[str, np.ndarray]:
    """Every candidate but surprisal for one layer: name -> [T, Hkv]."""
    q, k, v = mixer.proj.qkv(h, positions, mixer.lora)
    (sq, sk, sv), (lq, lk, lv), _ = mixer._window_and_linear_qkv(q, k, v, None)
    lq, lk = mixer.features(lq, lk)
    log_alpha, beta = mixer.gates(h, lk)
    return {
        "recall": recall_as_leaving(lk[0], lv[0], log_alpha[0], beta[0]),
        "key_norm": jnp.linalg.norm(sk[0].astype(jnp.float32), axis=-1),
        "value_norm": jnp.linalg.norm(sv[0].astype(jnp.float32), axis=-1),
        "attention": window_attention_mass(sq[0], sk[0]),
    }


def separation(score: np.ndarray, needle: list[int], others: np.ndarray) -> tuple[float, float]:
    """(AUC of the needle positions against the others, share of the needle among the SLOTS highest)."""
    s_needle, s_other = score[needle], score[others]
    auc = float(np.mean((s_needle[:, None] > s_other[None, :]) + 0.5 * (s_needle[:, None] == s_other[None, :])))
    candidates = np.concatenate([needle, others])
    top = set(candidates[np.argsort(-score[candidates], kind="stable")[:SLOTS]].tolist())
    return auc, float(np.mean([p in top for p in needle]))


def screen(model, tokenizer, sample) -> dict:
    """One prompt: each score's AUC and top-64 share per cache, and their means."""
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    first, end = token_span(tokenizer, sample.prompt, sample.needle)
    value_first, value_end = token_span(tokenizer, sample.prompt, sample.answers[0], sample.prompt.index(sample.needle))
    needle = [p for p in range(value_first, value_end) if tokenizer.decode([ids[p]]).strip()]
    leaving = np.arange(SINKS, len(ids) - WINDOW)  # the tokens that leave the window before the prompt ends
    others = leaving[(leaving < first) | (leaving >= end)]
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits = model(tokens)[0].astype(jnp.float32)
    nll = -jax.nn.log_softmax(logits[:-1], axis=-1)[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    surprisal = np.concatenate([[0.0], np.asarray(nll)])  # token t's surprisal given the tokens before it
    per_score = {name: {"auc": [], "top": []} for name in SCORES}
    for layer, acts in enumerate(model.attention_activations(tokens)):
        mixer = model.layers[layer].attn
        scores = {name: np.asarray(s) for name, s in layer_scores(mixer, acts.input, positions).items()}
        for head in range(next(iter(scores.values())).shape[1]):
            for name in SCORES:
                s = surprisal if name == "surprisal" else scores[name][:, head]
                auc, top = separation(s, needle, others)
                per_score[name]["auc"].append(auc)
                per_score[name]["top"].append(top)
    return {"depth": sample.depth, "value_tokens": needle,
            "scores": {name: {"auc_mean": float(np.mean(v["auc"])), "auc_best_cache": float(np.max(v["auc"])),
                              "top64_share_mean": float(np.mean(v["top"])),
                              "caches_holding_all": float(np.mean(np.asarray(v["top"]) == 1.0))}
                       for name, v in per_score.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(CELL_TASKS), default="niah2")
    parser.add_argument("--length", type=int, choices=(1024, 2048, 4096), default=2048)
    parser.add_argument("--prompts", type=int, default=8, help="the cell's first N prompts (1-20)")
    parser.add_argument("--run", choices=sorted(RUNS), default="trained",
                        help="final: the final recipe; trained: the final recipe trained with 64 retained tokens")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= 20:
        parser.error(f"--prompts must be 1-20 (a cell has 20 prompts); got {args.prompts}")
    task = CELL_TASKS[args.task]
    run = RUNS[args.run][0]
    model, tokenizer, _ = load_model(run)
    model = with_budget(model, sinks=SINKS, window=WINDOW, retain=0)
    generator = Generator(tokenizer, None)
    rng = np.random.default_rng([SEED, TASKS.index(task), args.length])
    samples = [generator.sample(task, args.length, rng) for _ in range(args.prompts)]
    out = os.path.join(RESULTS, "retention", f"scores-{args.run}-{args.task}-{args.length}.json")
    rows = []
    for index, sample in enumerate(samples):
        row = {"sample": index, **screen(model, tokenizer, sample)}
        rows.append(row)
        print(f"sample {index} (depth {row['depth']:.2f}): " + ", ".join(
            f"{name} AUC {s['auc_mean']:.2f} top-64 {s['top64_share_mean']:.2f}" for name, s in row["scores"].items()),
            flush=True)
        keys = ("auc_mean", "auc_best_cache", "top64_share_mean", "caches_holding_all")
        means = {name: {key: float(np.mean([row["scores"][name][key] for row in rows])) for key in keys}
                 for name in SCORES}
        write_json(out, {"run": os.path.relpath(run, os.path.dirname(HERE)), "task": task,  # written
                         "length": args.length, "sinks": SINKS, "window": WINDOW, "slots": SLOTS,  # after each
                         "mean_over_prompts": means, "prompts": rows})  # prompt, so a stopped screen keeps them
    for name, m in means.items():
        print(f"{name:>10}: AUC {m['auc_mean']:.3f} (best cache {m['auc_best_cache']:.3f}), share of the value "
              f"among the 64 highest {m['top64_share_mean']:.3f}, "
              f"caches holding all of it {m['caches_holding_all']:.3f}")
    print(f"-> {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
