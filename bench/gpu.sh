#!/usr/bin/env bash
# The 1b bf16 comparison and epoch figure on one NVIDIA H200 (Python 3.12, jax 0.11.2 CUDA
# preinstalled, no package registry). Run from anywhere: `bash bench/gpu.sh`.
# Budget: under 8 minutes in all. Writes bench/results/gpu_offload.json and its table
# gpu_offload.txt (bench.offload: offload levels by XLA's figures), bench/results/gpu_1b.json
# (rewritten after every shape, with "partial": true until the run completes), gpu_1b.log,
# and the Markdown table and figures under bench/results/gpu/ (--results-dir).
#
# Scope, chosen to fit 8 minutes: the 1b preset's widths (d_model 2048, 32 heads, 4 KV heads,
# d_ff 5632, vocab 32000, bf16 compute) with 2 of its 22 layers (jaxmem's symbolic analysis
# and XLA's GPU compiles grow with depth; override with LAYERS=22 given more time), b=8, the
# p90 and longest per-batch lengths of the built-in data (max_len 2048), 3 repeats, 4 epoch
# batches. Matplotlib is optional there: without it the JSON and table are still written.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
mkdir -p "$OUT/gpu"
LAYERS="${LAYERS:-2}"
LIMIT_S="${LIMIT_S:-450}"

# Allocate on demand so that memory_stats()["peak_bytes_in_use"] means what the steps used.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

python - <<'EOF'
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
assert jax.default_backend() == "gpu", "bench/gpu.sh expects a CUDA backend"
EOF

# Host offload first (about a minute): CPU cannot measure it, so this is its only check.
timeout 120 python -m bench.offload --out "$OUT/gpu_offload.json" 2>&1 | tee "$OUT/gpu_offload.log" \
    || echo "bench.offload did not finish; see $OUT/gpu_offload.log"

# `timeout` stops a run that overruns; the JSON written so far stays (it is saved per shape).
set +e
timeout --signal=INT "$LIMIT_S" python -m bench.compare \
    --model 1b --layers "$LAYERS" --max-len 2048 \
    --batch 8 --quantiles 0.9 1.0 --repeats 3 --epoch-batches 4 \
    --budget-fraction 0.95 --no-analyze --no-timeline \
    --results-dir "$OUT/gpu" \
    --out "$OUT/gpu_1b.json" 2>&1 | tee "$OUT/gpu_1b.log"
status=${PIPESTATUS[0]}
echo "bench.compare exit status $status; results in $OUT/gpu_1b.json"
exit "$status"
