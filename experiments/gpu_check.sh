#!/usr/bin/env bash
# One-shot accelerator check, under 8 minutes on one NVIDIA GPU with jax
# installed: bf16 train MFU at the base and big sizes against the GPU's measured
# bf16 matmul peak, the library's einsum attention vs
# jax.nn.dot_product_attention (xla, cudnn), and cached decode throughput.
# Without a GPU it runs tiny sizes on the CPU and says it fell back.
#
#   bash experiments/gpu_check.sh [--json PATH] [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
json=gpu_check.json
args=()
while (($#)); do
  case "$1" in
    --json) json="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
exec timeout 470 "${PYTHON:-python}" -m experiments.benchmark --gpu_check \
  --json "$json" "${args[@]}"
