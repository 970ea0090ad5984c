"""`linjax eval lm-eval`: the paper's downstream suite through EleutherAI's lm-evaluation-harness.

    run(model_spec, tasks=["piqa", "arc_easy"], data_dir=None | DIR, limit=None, out_dir=DIR)

The model: an exported Hugging Face directory (has config.json; a linearized linjax export
loads with trust_remote_code=True, given only to linjax's own modeling files, see
`remote_code_trusted`), or anything `linjax.eval.models.load_model` accepts
(smollm2-135m, a checkpoint, a training run directory, ...), exported on the fly with
`linjax.save_hf` into a temporary directory. It is scored in float32 (on CUDA when torch sees
a GPU) by `SharedPrefixHFLM` (eval/shared_prefix_lm.py): lm-eval's HFLM with each shared
context prefix computed once: the same log-likelihoods, computed with fewer tokens (MMLU
5-shot repeats its few-shot prefix before every question); `share_prefixes=False` uses HFLM
as it is. Results are written after every task; `resume=True` keeps the tasks an interrupted
run finished. `samples=True` also writes each task's per-document scores (`sample_records`)
to samples_<task>.jsonl: tests/test_lm_eval.py pins them for SmolLM2-135M against lm-eval's
stock HFLM on the model transformers loads from the GGUF (tests/fixtures/make_lm_eval_expected.py).

Tasks (user names): piqa, arc_easy, arc_challenge, hellaswag, winogrande (0-shot),
mmlu (5-shot), lambada_openai (0-shot; perplexity and acc); also one MMLU subject,
mmlu_<subject> (5-shot). `num_fewshot` overrides the per-task default for all tasks.

- Without data_dir: lm-eval's standard tasks of those names (data from the Hugging Face hub).
- With data_dir (the layout of the project's data folder, see its README.md): the local
  tasks shipped in `linjax/eval/lm_eval_tasks/`, named `linjax_<name>` (`linjax_mmlu` is a
  group of the 57 `linjax_mmlu_<subject>` tasks in four category groups, as lm-eval's
  `mmlu`). Their YAML files copy lm-eval's standard definitions (prompt, target, choices,
  metrics, MMLU's descriptions and first-n dev few-shot examples) and replace the hub
  dataset with an lm-eval `custom_dataset` function of `lm_eval_tasks/linjax_tasks.py`,
  which reads the local files into documents with the hub dataset's fields. The YAML files
  cannot know where the data is: `run` builds `TaskManager(include_path=<that folder>,
  metadata={"linjax_data_dir": DIR})`, and lm-eval hands task metadata to
  `custom_dataset` as keyword arguments ($LINJAX_DATA_DIR is the fallback). Results are
  reported under the user names.

Known differences from lm-eval's standard tasks: HellaSwag's local text file joins ctx_a and
ctx_b without lm-eval's `ctx_b.capitalize()`; it is approximated by capitalizing a trailing
lower-case fragment after the last sentence end (acc_norm close to, not identical with,
lm-eval's). ARC fields and WinoGrande's partial scoring are as lm-eval's.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import re
import tempfile
import time

import linjax
from linjax import heartbeat
from linjax.eval.models import load_model
from linjax.eval.request_cache import RequestCache, caching_lm
from linjax.files import read_json, verify_output, write_json, write_text, writer_lock

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
PAPER_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu", "lambada_openai")
DEFAULT_FEWSHOT = {"mmlu": 5}
LOCAL_PREFIX = "linjax_"
REQUESTS_PREFIX = "lm_eval_requests-"  # + the model digest's first 16 hex digits + .jsonl: linjax's request cache


def task_name(name: str, local: bool) -> str:
    """lm-eval's name of a user task name."""
    subject = name.startswith("mmlu_") and os.path.exists(os.path.join(TASKS_DIR, f"linjax_{name}.yaml"))
    if name not in PAPER_TASKS and not subject:
        raise ValueError(f"unknown task {name!r}; one of {', '.join(PAPER_TASKS)}, or mmlu_<subject>")
    return LOCAL_PREFIX + name if local else name


class _QuietCustomDataset:
    """Drops lm-eval's per-task hint about custom_dataset kwargs (one line per MMLU subject)."""

    @staticmethod
    def filter(record):
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(data_dir: str | None = None):
    """lm-eval TaskManager: the standard tasks, or (data_dir given) only linjax's local tasks."""
    from lm_eval.tasks import TaskManager  # lm-eval is optional (`pip install linjax[eval]`)

    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in logger.filters):
        logger.addFilter(_QuietCustomDataset())
    if data_dir is None:
        return TaskManager()
    return TaskManager(include_path=TASKS_DIR, include_defaults=False,
                       metadata={"linjax_data_dir": os.path.abspath(data_dir)})


def load_tasks(names, data_dir: str | None = None):
    """{lm-eval task name: Task} of the leaf tasks of user task names (for inspection and tests)."""
    local = data_dir is not None
    return task_manager(data_dir).load([task_name(n, local) for n in names])["tasks"]


def evaluate_task(lm, name: str, *, num_fewshot: int, limit, manager, log_samples: bool = False) -> dict:
    """lm-eval's simple_evaluate of one lm-eval task name with the bridge's settings (seeds, bootstrap).
    Never with lm-eval's request cache (`use_cache`), which unpickles what its file holds: `run` keeps
    its own (`request_cache.caching_lm`)."""
    import lm_eval  # optional: `pip install linjax[eval]`

    return lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples, bootstrap_iters=1000,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0, use_cache=None)


def _short_hash(x) -> str:
    return hashlib.sha256(json.dumps(x, ensure_ascii=False).encode()).hexdigest()[:16]


def sample_records(samples) -> list[dict]:
    """Per-document scores of one task from lm-eval's logged samples (simple_evaluate(log_samples=True)):
    doc_id, lm-eval's doc_hash, the target, one 16-hex SHA-256 of each request's [context, continuation]
    (a changed prompt, target or document changes it), the continuations, each request's log-likelihood
    and is_greedy flag, the chosen answer (the highest log-likelihood; None for a single request, as
    LAMBADA's) and lm-eval's per-document metrics. In doc_id order."""
    records = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        scores = [r[0] for r in s["resps"]]  # one (log-likelihood, is_greedy) per request
        lls = [float(ll) for ll, _ in scores]
        records.append({
            "doc_id": int(s["doc_id"]), "doc_hash": s.get("doc_hash"), "target": _jsonable(s["target"]),
            "requests": [_short_hash([str(a) for a in args]) for args in s["arguments"]],
            "continuations": [str(args[-1]) for args in s["arguments"]],
            "loglikelihoods": lls, "is_greedy": [bool(g) for _, g in scores],
            "chosen": max(range(len(lls)), key=lls.__getitem__) if len(lls) > 1 else None,
            "metrics": {m: _jsonable(s[m]) for m in s.get("metrics", []) if m in s},
        })
    return records


# Files whose `auto_map` transformers follows to Python code when loading a directory: the model's config,
# its tokenizer's, and the processors' (AutoProcessor, AutoImageProcessor, AutoFeatureExtractor, ...).
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                  "feature_extractor_config.json", "image_processor_config.json", "video_preprocessor_config.json")


def remote_code_trusted(directory: str, trust_remote_code: bool = False) -> bool:
    """Whether transformers may run the Python files of HF directory `directory` (trust_remote_code).

    Only when every `auto_map` a loader follows (config, tokenizer, processor files: `AUTO_MAP_FILES`)
    names a module of linjax's export code (convert/modeling_linjax*.py, none from the hub) and every
    .py file there is byte-identical to it (a linjax export of a linearized model), or the user said
    `trust_remote_code`. Any other code asked for is refused (ValueError naming the file and the
    reference): running a downloaded folder's Python is the user's decision. Without any `auto_map`
    nothing needs to run."""
    from linjax.convert.export import MODELING_FILES

    maps = {}
    for name in AUTO_MAP_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            document = read_json(path)
            auto_map = document.get("auto_map") if isinstance(document, dict) else None
            if auto_map:
                maps[name] = auto_map
    if not maps or trust_remote_code:
        return bool(maps)
    ours = {os.path.basename(path): path for path in MODELING_FILES}
    theirs = sorted(name for name in os.listdir(directory) if name.endswith(".py"))
    foreign = [name for name in theirs if name not in ours or not _same_bytes(os.path.join(directory, name),
                                                                            ours[name])]
    # A reference of the form "org/repo--module.Class" fetches code from the hub instead.
    remote = [f"{ref} ({name})" for name, auto_map in maps.items() for ref in _references(auto_map) if "--" in ref]
    missing = [f"{ref} ({name})" for name, auto_map in maps.items() for ref in _references(auto_map)
               if "--" not in ref and f"{ref.rsplit('.', 1)[0]}.py" not in ours]
    if foreign or remote or missing or not theirs:
        what = f"files that are not linjax's own export code: {', '.join(foreign)}" if foreign else \
            f"code from elsewhere: {', '.join(remote)}" if remote else \
            f"code that is not linjax's export code: {', '.join(missing)}" if missing else "code it does not hold"
        older = foreign and all(name in ours for name in foreign)  # e.g. exported by another linjax version
        hint = " (or export the model again with this linjax)" if older else ""
        raise ValueError(f"{directory} asks transformers to run its own Python (auto_map in "
                         f"{', '.join(maps)}), {what}. Pass --trust-remote-code if you trust that code{hint}")
    return True


def _references(auto_map) -> list[str]:
    """The "module.Class" strings of an auto_map (a tokenizer's entry is a pair)."""
    refs = []
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    for value in values:
        refs.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str))
    return refs


def _same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def is_hf_directory(path: str) -> bool:
    """A transformers model directory (config.json with a model_type), not e.g. a training run directory,
    whose config.json is the experiment."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "model_type" in json.load(f)


@contextlib.contextmanager
def hf_directory(model_spec: str):
    """An HF directory for the model: itself if it is one (checked against the hashes linjax recorded if
    it wrote it), else a temporary export."""
    if os.path.isdir(model_spec):
        verify_output(model_spec)  # first: a damaged config.json is named as damaged
    if is_hf_directory(model_spec):
        yield model_spec
        return
    model, tokenizer, _ = load_model(model_spec)
    if tokenizer is None:
        raise ValueError(f"{model_spec} has no tokenizer; lm-eval needs one")
    # A full fp32 export: registered with the watchdog, whose os._exit skips the cleanup below.
    with tempfile.TemporaryDirectory(prefix="linjax-lm-eval-") as tmp, heartbeat.temporary(tmp):
        linjax.save_hf(model, os.path.join(tmp, "model"), tokenizer)
        del model
        yield os.path.join(tmp, "model")


def default_out_dir(model_spec: str, resume: bool = False) -> str:
    """Where `linjax eval lm-eval` writes without --out: MODEL/lm_eval for a model directory, else
    runs/lm-eval/<model name>. Earlier results there are never overwritten: a new run takes the first
    free of DIR, DIR-2, DIR-3, ...; with `resume`, the latest of them that holds results."""
    if os.path.isdir(model_spec):
        base = os.path.join(os.path.abspath(model_spec), "lm_eval")
    else:  # a hub id, the embedded model's name, a .gguf file or an experiment TOML
        name = os.path.splitext(os.path.basename(model_spec))[0] if os.path.isfile(model_spec) else model_spec
        name = re.sub(r"[^A-Za-z0-9_.-]+", "--", name).strip(".-") or "model"
        base = os.path.abspath(os.path.join("runs", "lm-eval", name))
    candidates = (base if n == 1 else f"{base}-{n}" for n in itertools.count(1))
    latest_with_results = None
    for directory in candidates:
        if not os.path.exists(directory) or (os.path.isdir(directory) and not os.listdir(directory)):
            return latest_with_results if resume and latest_with_results else directory
        if os.path.isfile(os.path.join(directory, "lm_eval_results.json")):
            latest_with_results = directory


def _user_name(name: str) -> str:
    return name[len(LOCAL_PREFIX):] if name.startswith(LOCAL_PREFIX) else name


def _fmt(x) -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return "N/A" if isinstance(x, float) and math.isnan(x) else f"{x:.4f}"
    return str(x)


def table_markdown(results: dict, order) -> str:
    """task | metric | value | stderr, the tasks in `order` (user names), then any subtask."""
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task in order:
        metrics = results.get(task, {})
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or key.startswith("alias"):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}", "")
            lines.append(f"| {task} | {metric} | {_fmt(value)} | {_fmt(stderr) if stderr != '' else ''} |")
    return "\n".join(lines)


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def run(model_spec: str, *, tasks, data_dir: str | None = None, limit: int | float | None = None,
        num_fewshot: int | None = None, batch_size: int = 8, out_dir: str, share_prefixes: bool = True,
        resume: bool = False, samples: bool = False, trust_remote_code: bool = False) -> dict:
    """Evaluates a model on user-named tasks; writes lm_eval_results.json and results.md to out_dir.

    share_prefixes: score through `SharedPrefixHFLM` (each shared context prefix computed once; the same
    log-likelihoods as lm-eval's HFLM, which `share_prefixes=False` uses, in far fewer tokens).
    resume: keep what an earlier run with the same model and settings did in out_dir: its finished
    tasks, and the requests it scored of the task it was killed in (the model files must be unchanged).
    samples: also write samples_<task>.jsonl (one `sample_records` record a line) for every leaf task run.
    trust_remote_code: let transformers run an HF directory's own modeling code even when it is not linjax's
    (see `remote_code_trusted`).
    """
    # Optional and heavy (lm-eval, torch, transformers): `pip install linjax[eval]`.
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from linjax.eval.shared_prefix_lm import SharedPrefixHFLM

    if isinstance(limit, float) and limit >= 1 and limit.is_integer():
        limit = int(limit)
    tasks = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    local = data_dir is not None
    names = {t: task_name(t, local) for t in tasks}
    # one lm-eval call per task (its own few-shot setting: mmlu 5-shot, the rest 0-shot, as in the paper)
    shots_of = {t: num_fewshot if num_fewshot is not None else DEFAULT_FEWSHOT.get(t.split("_")[0], 0) for t in tasks}
    # lm-eval bootstraps perplexity's stderr in a forked multiprocessing pool: no fork under JAX
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    results, groups, n_samples, configs, versions, seconds = {}, {}, {}, {}, {}, {}
    start = time.perf_counter()
    digest = None

    def summary() -> dict:
        done = [t for t in tasks if t in seconds]
        out = {
            "model": model_spec, "model_sha256": digest, "tasks": tasks, "finished_tasks": done,
            "data_dir": os.path.abspath(data_dir) if local else None,
            "source": "local files" if local else "lm-eval hub tasks",
            "lm_eval_version": lm_eval.__version__, "limit": limit,
            "num_fewshot": shots_of, "batch_size": batch_size,
            "seconds": round(time.perf_counter() - start, 2),
            "seconds_per_task": {t: round(s, 2) for t, s in seconds.items()},
            "results": _jsonable(results), "groups": _jsonable(groups), "n-samples": _jsonable(n_samples),
            "versions": _jsonable(versions), "configs": _jsonable(configs),
        }
        out["table_markdown"] = table_markdown(out["results"], done)
        return out

    # One writer per output folder: two runs would interleave their results and request caches.
    with writer_lock(out_dir, f"the lm-eval output folder {os.path.abspath(out_dir)}"), \
            hf_directory(model_spec) as directory:
        # What the scores depend on is the model's files (weights and tokenizer), not the path: a model
        # retrained in place, or given another tokenizer, must not inherit the earlier finished tasks or
        # cached request scores.
        trusted = remote_code_trusted(directory, trust_remote_code)  # refused before any work
        manager = task_manager(data_dir)  # reading lm-eval's task files takes seconds: after the checks
        digest = model_digest(directory)
        if resume:
            earlier = _finished_earlier(out_dir, model_spec, data_dir, limit, shots_of, digest)
            for key, target in (("results", results), ("groups", groups), ("n-samples", n_samples),
                                ("configs", configs), ("versions", versions)):
                target.update(earlier.get(key, {}))  # written only once a task finished: all of it is kept
            seconds.update(earlier.get("seconds_per_task", {}))  # tasks of theirs not asked for now stay too
            finished = [t for t in tasks if t in seconds]
            print(f"resuming {out_dir}: {len(finished)} of {len(tasks)} tasks already finished", flush=True)
        # Every scored request goes into a request cache, written as it is scored, so a run killed inside a
        # long task resumes at the request it had reached: JSON that linjax writes (eval/request_cache.py),
        # never lm-eval's pickle store, which would run the code of a foreign file put in the folder. lm-eval
        # keys requests by their text only, so the file is named after the model files' digest.
        requests_path = os.path.join(out_dir, f"{REQUESTS_PREFIX}{digest[:16]}.jsonl")
        if not resume:  # a fresh run (the caller checked that replacing earlier results is meant)
            for path in glob.glob(os.path.join(out_dir, f"{REQUESTS_PREFIX}*.jsonl")) + \
                    glob.glob(os.path.join(out_dir, "samples_*.jsonl")):
                os.remove(path)
        _write(out_dir, summary())  # the settings before any work, for a later --resume to check
        lm_class = SharedPrefixHFLM if share_prefixes else HFLM
        lm = lm_class(pretrained=directory, trust_remote_code=trusted, device=_device(), dtype="float32",
                      batch_size=batch_size)
        lm.model.register_forward_hook(lambda *_: heartbeat.progress())  # each scored batch is progress
        cache = RequestCache(requests_path, fresh=not resume)
        cached = caching_lm(lm, cache)
        for t in tasks:
            if t in seconds:
                continue
            t0 = time.perf_counter()
            try:
                out = evaluate_task(cached, names[t], num_fewshot=shots_of[t], limit=limit, manager=manager,
                                    log_samples=samples)
            except BaseException:
                cache.close()
                raise
            seconds[t] = time.perf_counter() - t0
            print(f"lm-eval {t}: {seconds[t]:.1f} s", flush=True)
            for name, logged in (out.get("samples") or {}).items():
                _write_samples(out_dir, _user_name(name), sample_records(logged))
            for key, target in (("results", results), ("groups", groups), ("n-samples", n_samples),
                                ("configs", configs), ("versions", versions)):
                for name, value in (out.get(key) or {}).items():
                    target[_user_name(name)] = value
            _write(out_dir, summary())  # after every task: a long run killed halfway keeps what finished
        cache.close()
        os.remove(requests_path)  # every task finished: nothing left to resume
    return summary()


def _device() -> str:
    import torch  # optional: `pip install linjax[eval]`

    return "cuda" if torch.cuda.is_available() else "cpu"


# Files of an HF directory that decide how text becomes token ids.
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")


def _decides_scores(name: str) -> bool:
    return (name == "config.json" or name.endswith((".safetensors", ".bin", ".pt", ".pth", ".py"))
            or name.startswith("tokenizer") or name in TOKENIZER_FILES or name.endswith((".model", ".tiktoken")))


def model_digest(directory: str) -> str:
    """SHA-256 over the files of an HF directory that decide its scores (config, weights, modeling
    code, tokenizer), in name order: the identity of the model for resuming an evaluation."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if _decides_scores(name):
            digest.update(name.encode() + b"\0")
            with open(os.path.join(directory, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()


def _finished_earlier(out_dir: str, model_spec: str, data_dir, limit, shots_of: dict, digest: str) -> dict:
    """The summary an earlier run left in out_dir ({} if none); refused if it was run with other settings
    or on other weights."""
    path = os.path.join(out_dir, "lm_eval_results.json")
    if not os.path.exists(path):
        return {}
    earlier = read_json(path)
    if earlier.get("model_sha256") != digest:
        theirs = str(earlier.get("model_sha256"))[:16]
        raise ValueError(f"{path} was scored on other weights or tokenizer files than {model_spec!r} has now "
                         f"(content digest {theirs} there, {digest[:16]} now): resuming would mix two models. "
                         "Write to another --out, or run without --resume")
    theirs = (earlier.get("model"), earlier.get("data_dir"), earlier.get("limit"))
    ours = (model_spec, os.path.abspath(data_dir) if data_dir else None, limit)
    shots = {t: n for t, n in earlier.get("num_fewshot", {}).items() if t in shots_of}
    if theirs != ours or any(shots_of[t] != n for t, n in shots.items()):
        raise ValueError(f"{path} holds a run of model {theirs[0]!r}, data {theirs[1]!r}, limit {theirs[2]!r}, "
                         f"few-shot {earlier.get('num_fewshot')}; this one is {ours[0]!r}, {ours[1]!r}, {ours[2]!r}, "
                         f"{shots_of}. Resume with the same settings, or write to another --out")
    return earlier


def _write_samples(out_dir: str, task: str, records) -> None:
    """samples_<task>.jsonl, atomically."""
    write_text(os.path.join(out_dir, f"samples_{task}.jsonl"), "".join(json.dumps(r) + "\n" for r in records))


def _write(out_dir: str, summary: dict) -> None:
    """lm_eval_results.json and results.md, atomically."""
    write_json(os.path.join(out_dir, "lm_eval_results.json"), summary)
    write_text(os.path.join(out_dir, "results.md"),
               f"# lm-eval: {summary['model']}\n\n{summary['source']}, limit {summary['limit']}, "
               f"few-shot {summary['num_fewshot']}\n\n{summary['table_markdown']}\n")
