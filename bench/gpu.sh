#!/usr/bin/env bash
# Every GPU check in one script, under 5 minutes on one CUDA GPU; on a CPU it runs
# the same code at small sizes so that it is tested before any GPU sees it.
#   bash bench/gpu.sh            # after: pip install -e .
#   OUT=DIR bash bench/gpu.sh    # where the profile and the comparison go (default runs/gpu)
# With CUDA (one GPU):
#   1. precision: tokens/s, MFU and peak memory of each precision policy against torch.autocast
#      (gpt2-124m, 30 steps of batch 16; small, 40 steps of batch 64);
#   2. minigpt calibrate on the GPU (NCCL, one rank): fp32 matmuls up to 8192 with TF32 off, a
#      copy, gpt2-124m's pieces at micro-batches 1,2,4,8 -> $OUT/gpu-profile.json;
#   3. minigpt compare: train gpt2-124m (fp32, batch 8, one micro-batch) for 6 steps and simulate
#      it with that profile -> $OUT/compare.json (+ traces under $OUT/compare); prints
#      the predicted against the measured step.
# Without CUDA: the same three at tiny sizes on the CPU (gloo; calibrate on 2 ranks, compare
# on 1), so `PYTHON=.venv/bin/python bash bench/gpu.sh` checks the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out=${OUT:-runs/gpu}
mkdir -p "$out"
minigpt() { "$py" -m cli "$@"; }
print_step() {  # the predicted against the measured step time, from compare --json
  "$py" - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
error = r["step_time_relative_error"]
print("step time: predicted %.2f ms, measured %.2f ms (%s), profile %s" % (
    r["predicted_step_time_s"] * 1e3, r["measured_step_time_s"] * 1e3,
    "-" if error is None else "%+.1f%%" % (100 * error), r["hardware"]))
PY
}
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== precision: tokens/s, MFU and peak memory per policy, against torch.autocast (CUDA)"
  "$py" bench/mixed_precision.py --model gpt2-124m --steps 30 --batch-size 16
  "$py" bench/mixed_precision.py --model small --steps 40 --batch-size 64
  echo "== calibrate: this GPU (NCCL, one rank) -> $out/gpu-profile.json"
  minigpt calibrate --out "$out/gpu-profile.json" --model gpt2-124m --ranks 1 --micro-batches 1,2,4,8
  echo "== compare: gpt2-124m trained for 6 steps against the simulator with that profile"
  minigpt compare --hardware "$out/gpu-profile.json" --model gpt2-124m --batch-size 8 --steps 6 \
    --out "$out/compare" --json > "$out/compare.json"
  print_step "$out/compare.json"
else
  echo "== precision (no CUDA device: small CPU sizes)"
  "$py" bench/mixed_precision.py --model tiny --steps 6 --batch-size 8 --seq-len 64
  echo "== calibrate (no CUDA device: the CPU, gloo, 2 ranks, quick) -> $out/cpu-profile.json"
  minigpt calibrate --out "$out/cpu-profile.json" --model tiny --quick --ranks 2 --device cpu
  echo "== compare (no CUDA device: tiny, 1 rank, 3 steps on the CPU)"
  minigpt compare --hardware "$out/cpu-profile.json" --model tiny --batch-size 8 --steps 3 --device cpu \
    --out "$out/compare" --json > "$out/compare.json"
  print_step "$out/compare.json"
fi
