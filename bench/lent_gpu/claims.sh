# On a lent GPU machine, after bench/lent_gpu/setup.sh has had both halves of the model: train and evaluate
# claims rows until DEADLINE seconds after the start, then stop the runs (SIGTERM saves a checkpoint) and
# pack results/runs/ROW (and its stages) into $OUT.   bash bench/lent_gpu/claims.sh DEADLINE JOBS ROW...
# CELLS="PATTERN ..." also runs the retention grid beside them (experiments/retention.py run --only PATTERN,
# one process per pattern, each cell in turn) and copies the cells finished by the deadline to $OUT/retention.
start=$SECONDS; deadline=$1; jobs=$2; shift 2
bash bench/lent_gpu/setup.sh || exit 1
export PYTHONPATH=/tmp/site JAX_DEFAULT_MATMUL_PRECISION=${PREC:-highest} JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
echo "setup took $((SECONDS - start)) s"
# The CPU rows' settings unless CLAIMS_SETTINGS says otherwise (say, adding --set train.remat=none after
# bench/lent_gpu/probe.py has timed it).
python3 experiments/claims.py run "$@" --jobs $jobs \
  ${CLAIMS_SETTINGS:---set model.dtype=float32 --set linearize.kernel=chunked} > $OUT/claims.log 2>&1 &
pid=$!
touch /tmp/cells-start; mkdir -p $OUT/retention
set -f  # the patterns are experiments/retention.py's, not the shell's
for pattern in ${CELLS:-}; do python3 experiments/retention.py run --only "$pattern" >> $OUT/retention/cells.log 2>&1 & done
set +f
while [ -n "$(jobs -rp)" ] && (( SECONDS - start < deadline )); do  # the rows' chains and the cells
  sleep 15
  { echo "t=$((SECONDS - start))"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    for m in results/runs/*/metrics.jsonl; do echo "$m $(tail -1 $m | cut -c1-60)"; done; } >> $OUT/progress.log
done
# `linjax` re-executes itself as `python -c "...from linjax.app.cli import main; main()" ARGS`: match both forms.
# Each prints its stacks into its row's log (where it was), then training stops at a checkpoint.
pkill -TERM -f "retention.py run"  # before its cell's `linjax eval`, or it would start the next cell
pkill -USR1 -f "linjax\.app\.cli|bin/linjax "; sleep 3
pkill -TERM -f "(linjax\.app\.cli.*|bin/linjax) (train|eval) "; sleep 25
pkill -TERM -f claims.py
python3 bench/lent_gpu/pack.py "$OUT" "$@" $(python3 -P -c "import sys; sys.path.insert(0, 'results'); import claims; print(' '.join(s for r in sys.argv[1:] for s, *_ in claims.stages(r)))" "$@")
find results/retention -newer /tmp/cells-start -type f -exec cp {} $OUT/retention/ \;
echo "packed at t=$((SECONDS - start))"; ls -la $OUT
