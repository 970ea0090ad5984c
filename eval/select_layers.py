"""Which layers keep full attention in a hybrid (paper, "Hybrid Model").

Either evenly across depth, or the hardest-to-linearize layers by a hardness
signal: lowest key concentration, highest projection residual (from
`linjax eval diagnostics`), or highest nMSE (from `linjax eval approx`). The
result is a config fragment `linjax train --include` and `linjax run --include` accept:

    [linearize]
    keep_full_attention = [3, 11, 19]
"""

from __future__ import annotations

import json

from linjax.files import write_text

METRICS = {"concentration": ("concentration", "low"), "residual": ("residual", "high"), "nmse": ("nmse", "high")}


def keep_count(num_layers: int, keep: float) -> int:
    """`keep` as a fraction (0 < keep < 1) or a count (≥ 1) → how many layers keep full attention."""
    if keep <= 0 or (keep >= 1 and keep != int(keep)) or keep > num_layers:
        raise ValueError(f"--keep must be a fraction in (0, 1) or a whole count in [1, {num_layers}]; got {keep}")
    return int(keep) if keep >= 1 else max(1, round(keep * num_layers))


def uniform(num_layers: int, count: int) -> list[int]:
    """`count` layers evenly spaced over depth: the centre of each of `count` equal parts."""
    return sorted({int((i + 0.5) * num_layers / count) for i in range(count)})


def hardest(scores: dict[int, float], count: int, hard: str) -> list[int]:
    """The `count` layers with the lowest (hard="low") or highest (hard="high") score."""
    if count > len(scores):
        raise ValueError(f"asked for {count} layers but only {len(scores)} have scores")
    order = sorted(scores, key=lambda layer: scores[layer], reverse=hard == "high")
    return sorted(order[:count])


def scores_from_file(path: str, metric: str) -> tuple[dict[int, float], int | None]:
    """Per-layer scores from a diagnostics.json (concentration, residual) or approx.json (nmse),
    and the model's layer count when the file records it."""
    with open(path) as f:
        result = json.load(f)
    rows = result.get("per_layer") or []
    if not rows or metric not in rows[0]:
        source = "linjax eval approx" if metric == "nmse" else "linjax eval diagnostics"
        raise ValueError(f"{path} has no per-layer '{metric}' scores; make it with `{source}`")
    return {int(r["layer"]): float(r[metric]) for r in rows}, result.get("num_layers")


def select(num_layers: int | None, keep: float, by: str, scores_path: str | None = None) -> list[int]:
    """The layers that keep full attention. `num_layers` may be None when the scores file records it."""
    if by != "uniform" and by not in METRICS:
        raise ValueError(f"--by must be uniform, {', '.join(METRICS)}; got {by!r}")
    if by == "uniform":
        if num_layers is None:
            raise ValueError("--by uniform needs --layers (the model's number of layers)")
        return uniform(num_layers, keep_count(num_layers, keep))
    if scores_path is None:
        raise ValueError(f"--by {by} needs --scores: a JSON from `linjax eval "
                         f"{'approx' if by == 'nmse' else 'diagnostics'}`")
    field, hard = METRICS[by]
    scores, recorded = scores_from_file(scores_path, field)
    num_layers = num_layers or recorded
    if num_layers is None:
        raise ValueError(f"{scores_path} does not record the model's layer count; pass --layers")
    # A fraction counts the model's layers, not just the scored ones (an approx.json of a hybrid
    # student scores only its linearized layers).
    return hardest(scores, keep_count(num_layers, keep), hard)


def write_fragment(layers: list[int], path: str, comment: str = "") -> str:
    text = (f"# {comment}\n" if comment else "") + f"[linearize]\nkeep_full_attention = {json.dumps(layers)}\n"
    return write_text(path, text)


