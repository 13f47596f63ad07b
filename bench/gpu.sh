#!/usr/bin/env bash
# Every GPU measurement minigpt needs, in one call on a bare CUDA machine (Python 3 + torch), in the
# order of their value to the simulator; on a machine without CUDA the same steps at tiny sizes (the
# CPU dry run that CI runs, so this script cannot rot).
#
#   bash bench/gpu.sh                 # CUDA if there is one, else the CPU dry run
#   bash bench/gpu.sh --require-gpu   # no CUDA: one line, exit 3, nothing measured
#   OUT=DIR bash bench/gpu.sh         # where the results go (default: runs/gpu under the repository)
#
# Steps (each under its own time limit; a failed step prints "FAILED <step>" and the next one runs):
#   1. kernels    bench/gpu_kernels.py: GEMM efficiency by format (fp32, tf32, bf16, fp16, fp8 with and
#                 without fast accumulation) for square sizes and the real GEMMs of gpt2-124m and
#                 Llama 3 8B/70B/405B (also divided by tp 2/4/8), element-wise HBM bandwidth, launch
#                 overhead, attention (SDPA against unfused) at 1K-8K            -> kernels.json
#   2. calibrate  minigpt calibrate --device cuda: every format's table in the profile -> gpu-profile.json
#   3. compare    gpt2-124m trained 6 steps against the simulator with that profile    -> compare.json
#   4. precision  bench/mixed_precision.py --json: each policy against torch.autocast  -> precision.json
#   5. train      one real bf16 training run of gpt2-124m                              -> train.json
#   6. sustained  bench/gpu_sustained.py: a GEMM back to back for 25 s against its burst, bf16 and fp8, with
#                 the SM clock (the power limit's share: docs/efficiency.md, tensor_sustained), then one GPT-3 175B
#                 block forward and backward the same way beside the preset's price of it, and its kernels by
#                 class under torch.profiler (GEMMs, attention, the rest, the gaps) beside the preset's -> sustained.json
# plus gpu.log (everything printed, the machine first: nvidia-smi, torch, CUDA, capability) and summary.md
# (one row per step): 8 files at most in $OUT; runs and traces go to a scratch folder that is removed.
#
# Seen on one H200 (2026-12-04, docs/results.md "The first GPU"): steps 1-5 in 209 s (49, 47, 12, 50, 33 s),
# step 6 then about 75 s (before the block was added to it: about 40 s more). The estimate it was planned from, step by step, from FLOP counts at the rates
# measured on such a machine here (dense bf16 ~790 TFLOP/s on random data, a copy at ~4.3 TB/s) and the
# H100/H200 datasheet's fp32 (~60 TFLOP/s):
#   kernels    ~55 s: bench/gpu_kernels.py adds up its own calls (estimate_seconds, in its docstring);
#              --budget-s 150 stops it early if the GPU is far slower;
#   calibrate  ~40 s: ~80 timed GEMMs of 5 x 20 ms runs in five formats (~10 s), the copy, and the
#              gpt2-124m units at micro-batches 1-8 (one rank: no collectives, no sharing);
#   compare    ~25 s: 6 fp32 steps of gpt2-124m at batch 8 (8K tokens x ~0.9 GFLOP = 7 TFLOP, ~0.15 s a
#              step in fp32 at ~50 TFLOP/s) and a simulation;
#   precision  ~60 s: 30 steps of batch 16 in fp32, bf16, fp16, fp8 and autocast bf16/fp16 (14 TFLOP a
#              step: 0.3 s in fp32, 30-60 ms in 16-bit);
#   train      ~40 s: 200 bf16 steps of batch 16 (~50 ms each) and two evaluations;
#   sustained  ~115 s: per format 5 s idle, a 20-call burst, 25 s back to back; the block the same (~35 ms a
#              call: 20 calls and 25 s);
# plus ~8 s for each of the six Python starts with torch and CUDA. The limits below add to 570 s, inside
# one 10-minute device call.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
require_gpu=0
for arg in "$@"; do
  case "$arg" in
    --require-gpu) require_gpu=1 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --require-gpu or --help)" >&2; exit 2 ;;
  esac
done

py=${PYTHON:-$(command -v python3 || command -v python || true)}
if [ -z "$py" ] || ! "$py" -W ignore -c "import torch" 2>/dev/null; then
  echo "gpu.sh: no Python with torch (set PYTHON=/path/to/python that imports torch)" >&2
  exit 2
fi
cuda=$("$py" -W ignore -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
if [ "$cuda" != 1 ] && [ "$require_gpu" = 1 ]; then
  echo "gpu.sh: --require-gpu: torch $("$py" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null) sees no CUDA device; nothing measured" >&2
  exit 3
fi

out=${OUT:-$root/runs/gpu}
mkdir -p "$out" || { echo "gpu.sh: cannot create $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/minigpt-gpu.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
rm -f "$out/gpu.log"
exec > >(tee -a "$out/gpu.log") 2>&1
cd "$root"

# The repository itself is the package (no install needed); pure-Python dependencies the machine lacks
# come from the wheels in bench/vendor (a wheel of pure Python imports from its zip).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for wheel in "$root"/bench/vendor/*.whl; do
  module=$(basename "$wheel" | cut -d- -f1)
  if ! "$py" -c "import $module" 2>/dev/null; then
    export PYTHONPATH="$PYTHONPATH:$wheel"
    echo "gpu.sh: $module is not installed here: using $(basename "$wheel")"
  fi
done

{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "host: $(hostname 2>/dev/null || cat /proc/sys/kernel/hostname)"; echo "git: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$py" - <<'PY'
import platform, torch
print(f"python: {platform.python_version()}  torch: {torch.__version__}  CUDA (torch built with): {torch.version.cuda}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
              f"{p.multi_processor_count} SMs")
    print(f"cudnn: {torch.backends.cudnn.version()}  nccl: {'.'.join(map(str, torch.cuda.nccl.version()))}")
else:
    print("cuda: none (CPU dry run at tiny sizes)")
PY
  command -v nvidia-smi >/dev/null && nvidia-smi
} > "$scratch/env.txt" 2>&1
cat "$scratch/env.txt"

status="$scratch/status.tsv"
failed=0
run_step() {  # run_step NAME LIMIT_S RESULT_FILE COMMAND...: stdout to RESULT_FILE ("-": to the log)
  local name=$1 limit=$2 result=$3 start rc
  shift 3
  echo "== $name (limit ${limit} s): $*"
  start=$(date +%s%N)
  if [ "$result" = - ]; then
    timeout -k 10 "$limit" "$@"
  else
    timeout -k 10 "$limit" "$@" > "$result"
  fi
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( ($(date +%s%N) - start) / 1000000 ))" "$result" >> "$status"
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1))
    echo "FAILED $name (exit $rc$([ "$rc" = 124 ] && echo ': over its time limit'))"
  fi
}

if [ "$cuda" = 1 ]; then
  run_step kernels 120 - "$py" bench/gpu_kernels.py --out "$out/kernels.json" --budget-s 100
  run_step calibrate 90 - "$py" -m cli calibrate --device cuda --ranks 1 --allow-busy --model gpt2-124m \
    --micro-batches 1,2,4,8 --out "$out/gpu-profile.json"
  run_step compare 60 "$out/compare.json" "$py" -m cli compare --hardware "$out/gpu-profile.json" \
    --model gpt2-124m --batch-size 8 --steps 6 --out "$scratch/compare" --json
  run_step precision 90 "$out/precision.json" "$py" bench/mixed_precision.py --model gpt2-124m \
    --steps 30 --batch-size 16 --json
  run_step train 70 "$out/train.json" "$py" -m cli train --model gpt2-124m --precision bf16 --steps 200 \
    --batch-size 16 --eval-every 100 --out "$scratch/train" --json
  run_step sustained 140 - "$py" bench/gpu_sustained.py --out "$out/sustained.json" --seconds 25 --cool-s 5
else
  echo "gpu.sh: no CUDA device: the CPU dry run (the same steps at tiny sizes)"
  run_step kernels 60 - "$py" bench/gpu_kernels.py --out "$out/kernels.json" --dry-run
  run_step calibrate 90 - "$py" -m cli calibrate --device cpu --ranks 1 --quick --allow-busy --model tiny \
    --micro-batches 1,4 --formats fp32,bf16,fp8 --out "$out/gpu-profile.json"
  run_step compare 60 "$out/compare.json" "$py" -m cli compare --hardware "$out/gpu-profile.json" \
    --model tiny --batch-size 8 --steps 3 --device cpu --out "$scratch/compare" --json
  run_step precision 90 "$out/precision.json" "$py" bench/mixed_precision.py --model tiny --steps 4 \
    --batch-size 8 --seq-len 64 --device cpu --json
  run_step train 60 "$out/train.json" "$py" -m cli train --model tiny --precision bf16 --steps 8 \
    --batch-size 8 --seq-len 64 --device cpu --out "$scratch/train" --json
  run_step sustained 30 - "$py" bench/gpu_sustained.py --out "$out/sustained.json" --dry-run
fi

"$py" bench/gpu_summary.py "$status" "$out" | tee "$out/summary.md"
echo "gpu.sh: $failed step(s) failed; results in $out"
[ "$failed" = 0 ]
