"""Per-layer decode caches of the PyTorch mirror: what linjax's decode states hold (linjax/mixers/states.py).

Each layer's mixer makes its own (`new_cache`): softmax attention a growing `KeyValueCache`,
the window-only baseline a `KeyValueCache` of the sinks and the window, a linear mixer a
`LinearLayerCache` (with `RetainedSlots` when `linearize.retain` > 0). modeling_linjax.py's
LinjaxCache holds one per layer for `generate`.
Imports only torch.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's part of `LinjaxCache`; the flags are what transformers' Cache asks of its layers."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def tensors(self) -> dict:
        """The batch-first tensors held, by attribute name (None entries: not filled yet)."""
        raise NotImplementedError

    def map_tensors(self, fn):
        """Applies fn to every held tensor along the batch axis (beam reordering, batch selection)."""
        for name, value in self.tensors().items():
            if isinstance(value, list):
                setattr(self, name, [fn(x) for x in value])
            elif isinstance(value, dict):
                setattr(self, name, {key: fn(x) for key, x in value.items()})
            elif value is not None:
                setattr(self, name, fn(value))

    def get_seq_length(self) -> int:
        raise NotImplementedError("LinjaxCache counts tokens for all layers: call cache.get_seq_length()")

    def get_max_length(self) -> int:
        return -1  # no fixed size: softmax layers grow, the others keep a bounded state


class KeyValueCache(LayerCache):
    """Post-RoPE keys/values [B,L,Hkv,D] with their positions [L] that later queries attend to:
    all of them (window None: full softmax attention), or the first `sinks` and the last `window`
    (kernels/swa.py WindowCache, kept in position order instead of a ring)."""

    def __init__(self, sinks: int = 0, window: int | None = None):
        self.sinks, self.window = sinks, window
        self.keys = self.values = self.positions = None
        self.length = 0  # tokens seen

    def tensors(self):
        return {"keys": self.keys, "values": self.values}

    def reset(self):
        self.keys = self.values = self.positions = None
        self.length = 0

    def latest(self, count: int, like):
        """[keys, values] of the last `count` tokens seen [B,count,Hkv,D], oldest first, zeros before the
        sequence (`like`: a tensor of one such token's shape and dtype, [B,1,Hkv,D])."""
        held = 0 if self.keys is None else min(count, self.keys.shape[1])
        zeros = like.new_zeros(like.shape[0], count - held, *like.shape[2:])
        if not held:
            return [zeros, zeros]
        return [torch.cat([zeros, x[:, x.shape[1] - held:].to(like.dtype)], dim=1) for x in (self.keys, self.values)]

    def extend(self, k, v, positions):
        """(keys, values, key positions) to attend over, the new ones last; keeps what later tokens need."""
        self.length += k.shape[1]
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
            positions = torch.cat([self.positions, positions])
        kept = (k, v, positions)
        if self.window is not None:
            # Held: positions 0 .. head − 1 (sinks not yet in the window) and the `tail` latest, in order.
            last = self.length - 1
            head, tail = max(0, min(self.sinks, last - self.window + 1)), min(self.window, self.length)
            kept = tuple(torch.cat([x[:, :head], x[:, x.shape[1] - tail:]], dim=1) for x in (k, v))
            kept += (torch.cat([positions[:head], positions[positions.shape[0] - tail:]]),)
        self.keys, self.values, self.positions = kept
        return k, v, positions


class LinearLayerCache(LayerCache):
    """A linear layer's decode state, linjax's LinearState: its size does not grow with the context."""

    def __init__(self, sinks: int, window: int):
        self.retained = None  # RetainedSlots (linearize.retain > 0) once a token has left the window
        self.recurrent = None  # S [B,H,Dk',Dv'] (fp32) over positions sinks .. t − window
        self.conv = None  # {"q","k","v"}: short-conv inputs of the last K − 1 tokens [B,K−1,C] (fp32)
        self.window = KeyValueCache(sinks, window) if window else None  # the sinks' and the window's k, v
        self.shifted = None  # [k', v', *gates] of the last `window` tokens, oldest first [B,window,...]
        # retain_score "attention": the softmax mass each of the last `window` tokens has received (averaged
        # over query heads), oldest first [B,window,Hkv] fp32 (linjax's SinksWindowCache.mass)
        self.mass = None

    def tensors(self):
        return {"recurrent": self.recurrent, "conv": self.conv, "shifted": self.shifted, "mass": self.mass}

    def map_tensors(self, fn):
        super().map_tensors(fn)
        for part in (self.window, self.retained):
            if part is not None:
                part.map_tensors(fn)

    def reset(self):
        self.recurrent = self.conv = self.shifted = self.retained = self.mass = None
        if self.window is not None:
            self.window.reset()


class RetainedSlots(LayerCache):
    """R tokens per kv head kept for their content beside the sinks and the window (linjax's
    kernels/retention.py RetainedCache): the pretrained keys and values the softmax reads
    [B,R,Hkv,D], the linear inputs each is written into the state with if it loses its slot
    (k', v' per kv head, the gates other than the decay per query head: [B,R,heads,...]), its
    score [B,R,Hkv] (−inf where empty) and position [B,R,Hkv] (−1 where empty). Fixed size."""

    def __init__(self, retain: int, candidate: list):
        """No token retained yet; `candidate`: one token's entries [B,heads,...] (shapes and dtypes)."""
        keys, values, *linear = (x.new_zeros(x.shape[0], retain, *x.shape[1:]) for x in candidate)
        self.keys, self.values, self.linear = keys, values, linear
        kv = candidate[0].shape[:2]
        self.score = torch.full((kv[0], retain, kv[1]), -torch.inf, device=keys.device)
        self.position = torch.full((kv[0], retain, kv[1]), -1, dtype=torch.long, device=keys.device)

    def tensors(self):
        return {"keys": self.keys, "values": self.values, "linear": self.linear, "score": self.score,
                "position": self.position}

    def entries(self) -> list:
        """What travels with a token into a slot: [keys, values, *linear]."""
        return [self.keys, self.values, *self.linear]

    def set_entries(self, entries: list):
        self.keys, self.values, *self.linear = entries

