"""lm-eval's request cache kept as JSON Lines: a resumed evaluation never unpickles anything.

lm-eval's own cache (`simple_evaluate(use_cache=PATH)`) is a SqliteDict, which stores each result
with pickle; an evaluation resumed in a shared output folder would unpickle a `.db` file someone
else put there, and unpickling runs code. `RequestCache` holds the same things, each request's
result under lm-eval's hash of the request (`hash_args`), as one JSON object per line, appended
and flushed as each request is scored (HFLM reports every result through its cache hook), so a
run killed inside a task resumes at the request it had reached. Reading it parses JSON only, and
only results of the forms lm-eval's requests return: a line cut short by a kill, or of any other
form, is skipped (that request is scored again).

    cache = RequestCache(path, fresh=not resume)
    lm = caching_lm(HFLM(...), cache)     # an lm-eval LM: pass it to simple_evaluate
"""

from __future__ import annotations

import json
import os
import re

from linjax.files import write_text

_KEY = re.compile(r"[0-9a-f]{64}")


def _result(value):
    """A result as lm-eval returns it (loglikelihood: (float, bool); loglikelihood_rolling: float;
    generate_until: str), or None if `value` is of no such form."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (int, float)) \
            and not isinstance(value[0], bool) and isinstance(value[1], bool):
        return float(value[0]), value[1]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return value
    return None


def _plain(value):
    """A result as JSON takes it (numpy and torch scalars as Python numbers)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


class RequestCache:
    """{lm-eval request hash: result}, kept in a JSON Lines file (see the module docstring). `fresh`:
    start empty, replacing what the file held."""

    def __init__(self, path: str, fresh: bool):
        self.path = path
        self.results: dict = {}
        if fresh or not os.path.exists(path):
            write_text(path, "")
        else:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue  # cut short by a kill
                    if not isinstance(entry, dict) or not _KEY.fullmatch(str(entry.get("request"))):
                        continue
                    result = _result(entry.get("result"))
                    if result is not None:
                        self.results[entry["request"]] = result
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (appended to as requests are scored; close())

    def __contains__(self, key: str) -> bool:
        return key in self.results

    def __getitem__(self, key: str):
        return self.results[key]

    def __setitem__(self, key: str, value) -> None:
        self.results[key] = value
        self.file.write(json.dumps({"request": key, "result": _plain(value)}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def caching_lm(lm, cache: RequestCache):
    """`lm` (an lm-eval LM) answering the requests `cache` holds from it, and adding each one it scores."""
    from lm_eval.api.model import LM, CacheHook, hash_args  # lm-eval is optional: `pip install linjax[eval]`

    class _Hook(CacheHook):
        def __init__(self):
            self.dbdict = None  # lm-eval's hook writes to a SqliteDict there; this one to the JSON cache

        def add_partial(self, attr, req, res) -> None:
            cache[hash_args(attr, req)] = res

    class CachingLM(LM):
        """lm-eval's CachingLM over the JSON cache; every other attribute is the wrapped LM's."""

        def __init__(self):
            super().__init__()
            self.lm = lm
            lm.set_cache_hook(_Hook())

        def __getattr__(self, name):
            return getattr(self.lm, name)

        device = property(lambda self: self.lm.device)
        rank = property(lambda self: self.lm.rank)
        world_size = property(lambda self: self.lm.world_size)
        tokenizer_name = property(lambda self: self.lm.tokenizer_name)

        def apply_chat_template(self, *args, **kwargs):
            return self.lm.apply_chat_template(*args, **kwargs)

        def chat_template(self, *args, **kwargs):
            return self.lm.chat_template(*args, **kwargs)

        def all_gather(self, tensor):
            return self.lm.all_gather(tensor)

        def gather_object(self, obj, dst=0):
            return self.lm.gather_object(obj, dst)

        def barrier(self):
            return self.lm.barrier()

        def _answer(self, attr, requests):
            results, remaining = [], []
            for request in requests:
                sampled = attr == "generate_until" and request.args[1].get("do_sample", False)
                key = hash_args(attr, request.args)
                if not sampled and key in cache:  # a sampled generation is never reused
                    results.append(cache[key])
                else:
                    results.append(None)
                    remaining.append(request)
            new = iter(getattr(self.lm, attr)(remaining) if remaining else [])
            for i, request in enumerate(requests):
                if results[i] is None:
                    results[i] = next(new)
                    key = hash_args(attr, request.args)
                    if key not in cache:  # HFLM's hook added most as it scored them
                        cache[key] = results[i]
            return results

        def loglikelihood(self, requests):
            return self._answer("loglikelihood", requests)

        def loglikelihood_rolling(self, requests):
            return self._answer("loglikelihood_rolling", requests)

        def generate_until(self, requests):
            return self._answer("generate_until", requests)

    return CachingLM()
