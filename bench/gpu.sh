#!/usr/bin/env bash
# Every GPU check in one script, under 5 minutes on one CUDA GPU; on a CPU it runs
# the same code at small sizes so that it is tested before any GPU sees it.
#   bash bench/gpu.sh            # after: pip install -e .
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== precision: tokens/s, MFU and peak memory per policy, against torch.autocast (CUDA)"
  "$py" bench/mixed_precision.py --model gpt2-124m --steps 30 --batch-size 16
  "$py" bench/mixed_precision.py --model small --steps 40 --batch-size 64
else
  echo "== precision (no CUDA device: small CPU sizes)"
  "$py" bench/mixed_precision.py --model tiny --steps 6 --batch-size 8 --seq-len 64
fi
