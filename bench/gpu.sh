#!/usr/bin/env bash
# jaxmem's checks on one NVIDIA H200 (Python 3.12, jax 0.11.2 CUDA preinstalled, no package
# registry), sized for the 15 minutes of device time a session is lent: under 10 minutes.
#
#   bash bench/gpu.sh [RESULTS_DIR]      # default bench/results/gpu
#
# Each stage has its own time limit and writes its JSON and table as it ends, so a stage
# that fails or overruns leaves the others' figures. Stages, most needed first (0: the
# tests that touch JAX internals, on the device's JAX version):
#   1. bench.offload   offload levels by XLA's own figures (CPU cannot measure offload);
#                      again with recomputation priced 1000x dearer (--slow-flops), since
#                      at the H200's rates the planner re-runs these matmuls instead
#   2. bench.reach     jaxmem's levels (offload planned: the backend has host memory)
#                      against per-layer jax.checkpoint, plain GPT and its lax.scan twin
#                      (REACH_PROGRAMS=... for another subset)
#   3. bench.accuracy  the memory model (fitted to XLA CPU) against XLA GPU's peaks
# FULL=1 adds the 1b-width comparison (bench.compare, 2 layers, b=8, max_len 2048).
set -uo pipefail
cd "$(dirname "$0")/.."

R="${1:-bench/results/gpu}"
mkdir -p "$R"
# Allocate on demand so that memory_stats()["peak_bytes_in_use"] means what the steps used.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

stage() {  # stage NAME LIMIT_S CMD...: runs CMD under a time limit, logs, never aborts
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --signal=INT "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS - t0)) s"
}

python - <<'EOF'
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
print("memory kinds:", [m.kind for m in jax.devices()[0].addressable_memories()])
EOF

# The tests that reach JAX's internals (scan params, loop and body rewrites, offload), on
# the device's JAX: session 20 found 0.11 breaks there that the CPU's 0.10 cannot show.
stage tests 150 python -m pytest -q -x -m "not slow" -p no:cacheprovider \
    tests/test_scan_params.py tests/test_loops.py tests/test_bodies.py tests/test_offload.py
stage offload 60 python -m bench.offload --out "$R/gpu_offload.json" --results-dir "$R"
stage offload-slow-flops 60 python -m bench.offload --slow-flops \
    --out "$R/gpu_offload_slow_flops.json" --results-dir "$R"
stage reach 200 python -m bench.reach --programs "${REACH_PROGRAMS:-gpt,gpt-scan}" \
    --shape 16,512 --repeats 5 --out "$R/gpu_reach.json" --results-dir "$R"
stage accuracy 150 python -m bench.accuracy --quick --no-timing \
    --out "$R/gpu_accuracy.json" --results-dir "$R"
if [ "${FULL:-0}" = 1 ]; then
    stage compare-1b 450 python -m bench.compare --model 1b --layers 2 --max-len 2048 \
        --batch 8 --quantiles 0.9 1.0 --repeats 3 --epoch-batches 4 \
        --budget-fraction 0.95 --no-analyze --no-timeline \
        --results-dir "$R" --out "$R/gpu_1b.json"
fi
ls -l "$R"
