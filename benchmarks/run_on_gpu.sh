#!/usr/bin/env bash
# The GPU checks, in one run on a machine with one NVIDIA GPU whose Python already has torch,
# jax (CUDA), flax and optax: `OUT=DIR bash benchmarks/run_on_gpu.sh [parity] [bench] [audit]`
# from the repository root (no step named: all three).
# Everything lands in $OUT (at most 8 files); docs/parity-gpu.md is written from them.
# Each step has its own time limit, so that one stuck step leaves the others' figures; together
# they stay under 600 s, a device command's limit (the first run took 274 s, before section 6
# gained its two experiment programs).
set -u
: "${OUT:?set OUT to the folder for the results}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
PY=${PY:-python3}
log=$OUT/gpu.log
steps=${*:-parity bench audit}
wanted() { [[ " $steps " == *" $1 "* ]]; }
step() {  # step SECONDS NAME COMMAND...: runs it under a time limit, its output in the log
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >>"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$log"
}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0]); [print(n, m.version(n)) for n in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "numpy")]'
  $PY -c 'import jax, torch; print("jax devices", jax.devices()); print("torch cuda", torch.cuda.get_device_name(0))'
} >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
# 1. the parity suite, quick: fp32 (JAX "highest", torch TF32 off), bf16 rows, the controls
if wanted parity; then
  step 180 parity $PY -m parity_tests --device cuda --quick --out "$OUT/parity"
  tar -czf "$OUT/parity.tgz" -C "$OUT" parity && rm -rf "$OUT/parity"
fi
# 2. ~100M bf16 GPT: accumulation overhead, against optax.MultiSteps; JAX vs torch tokens/s
wanted bench && step 260 bench $PY -m benchmarks --device cuda --sections 6 --cache-dir '' \
  --out "$OUT/benchmarks-gpu.md"
# 3. the audit at GPT-2-small size, JAX and torch (nanoGPT's loop), one process each
for framework_limit in jax:90 torch:50; do
  wanted audit || break
  framework=${framework_limit%:*}
  step "${framework_limit#*:}" "audit $framework" sh -c \
    "$PY -m benchmarks.audit_cost --one $framework 124M 1 --device cuda > '$OUT/audit-$framework.json'"
done
