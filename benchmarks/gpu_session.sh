#!/usr/bin/env bash
# The GPU measurements that docs/performance.md ("On a GPU") still lacks, as one command of about 9 minutes for a
# borrowed GPU (issue 33, item 7): each step under its own time limit, so one that runs long costs only its share.
#
#   bash benchmarks/gpu_session.sh RESULTS_DIR
#
# 1. jascl bench on bench-med: pas, then eval-plain and eval (the cases the 2026-11-28 H200 run did not reach);
# 2. jascl bench on bench-natural: eval-plain and eval again (the evaluator changed after that run: 0.145 then);
# 3. benchmarks/gpu_feed.py, the paper's 3D U-Net fed from the store, with cudnn_benchmark off, then on.
#
# RESULTS_DIR gets card.txt (GPU, driver, versions), one log per step, the benches' .md/.json, the feed's .json,
# summary.txt (each step's exit code and seconds; 124: stopped at its limit), and RESULTS_DIR.tar.gz of it all.
# Environment: DEVICE (default cuda; DEVICE=cpu checks the wiring on a machine without a GPU), PYTHON (default
# python3), LIMIT_SCALE (multiplies every step's limit; default 1).
set -u
if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu_session.sh RESULTS_DIR" >&2
    exit 2
fi
out=$1
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
scale=${LIMIT_SCALE:-1}
mkdir -p "$out"
: > "$out/summary.txt"

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S x LIMIT_SCALE seconds, its output in NAME.log
    local name=$1 limit start rc
    limit=$(awk -v l="$2" -v s="$scale" 'BEGIN { printf "%d", l * s }')
    shift 2
    start=$(date +%s)
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$out/summary.txt"
}

{
    date -u
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    else
        echo "no nvidia-smi"
    fi
    "$python" -c "import torch, monai, jascl; print('torch', torch.__version__, 'monai', monai.__version__)" 2>&1
    git rev-parse HEAD 2>/dev/null
} > "$out/card.txt"

bench=("$python" -m jascl bench --device "$device" --rounds 1 --epochs 3 --no-progress)
step bench-med-pas 150 "${bench[@]}" --protocol bench-med --cases pas --out "$out/bench-med-pas"
step bench-med-eval 120 "${bench[@]}" --protocol bench-med --cases eval-plain,eval --out "$out/bench-med-eval"
step bench-natural-eval 60 "${bench[@]}" --protocol bench-natural --cases eval-plain,eval \
    --out "$out/bench-natural-eval"
feed=("$python" benchmarks/gpu_feed.py --device "$device" --cases 16 --loader-workers 4 --epochs 2)
step feed-default 100 "${feed[@]}" --json "$out/feed-default.json"
step feed-cudnn-benchmark 100 "${feed[@]}" --set cudnn_benchmark=true --json "$out/feed-cudnn-benchmark.json"

tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "results: $out (and $out.tar.gz)"
