#!/usr/bin/env bash
# The GPU check in one run (under 8 minutes on one GPU): the `cuda` tests, then the GPU
# figures -- latency of source / bn_adapt / tent / adashadow (ResNet-50 224 px, batch 4)
# with their ratios, saved-activation bytes and step time of tent, tent 4-bit and
# adashadow under a memory budget, the served forward eager vs torch.compile, the serving
# table (ResNet-50 224 px b4 and b32, ResNet-18 224 px b8, the shipped small net b8: source
# eager, source with CUDA graphs, bn_adapt, tent, adashadow, adashadow parallel, in fp32 and
# fp16: ms, ratios to source, units updated, adapted %, predictions equal to fp32's), the
# Triton DAF kernels against the native path, and DAF through the shared loop (tent with
# every parameter trainable, ResNet-50 224 px b4: step time and CUDA step peak of dense, 8
# and 4 bits uniform, 12 % dynamic widths; amin/amax against the hybrid reduction at groups
# of 128 and 256).
#
#   bash benchmarks/gpu_check.sh             on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --dry-run   the same code paths on the CPU, tiny shapes
#
# Figures go to $GPU_CHECK_OUT (default docs/results/gpu; --dry-run: a temporary folder).
# Uses build/env.sh when the checkout is set up, else the machine's python3 with the
# checkout on PYTHONPATH (a bare GPU machine whose python3 holds torch and triton).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument '$1' (expected --dry-run or nothing)" >&2; exit 2 ;;
esac

if [[ -f build/env.sh ]]; then
  # shellcheck disable=SC1091
  . build/env.sh
  py=python
else
  site=$(mktemp -d)
  ln -s "$PWD/kernels" "$site/tta_kernels"  # the package the checkout installs as tta_kernels
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
  py=python3
fi
export PYTHONUNBUFFERED=1

if (( dry )); then
  device=cpu
  out=${GPU_CHECK_OUT:-$(mktemp -d)}
  tests=(-k "quantized or indexed")
  ratios=(--models resnet18:32:2 --batches 2 --warmup 1 --threads 1)
  figures=(--arch resnet18 --image-size 32 --batch-size 2 --batches 2 --no-compile
           --serving resnet18:32:2,card:32:2 --precisions fp32,bf16 --serving-batches 1
           --serving-warmup 1 --threads 1)  # bf16: fp16 needs CUDA
  kernels=(--dry-run)
  daf=(--arch resnet18 --image-size 32 --batch-size 2 --batches 2 --warmup 1 --threads 1)
else
  device=${TTA_TEST_DEVICE:-cuda}
  out=${GPU_CHECK_OUT:-docs/results/gpu}
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else
    'gpu_check.sh: torch sees no CUDA device (use --dry-run on a machine without one)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  tests=()
  ratios=(--models resnet50:224:4 --batches 20 --warmup 5)
  figures=()
  kernels=()
  daf=()
fi
mkdir -p "$out"
echo "== device $device, figures in $out"

failed=()
part() {  # run one part; a failure is reported at the end, the later parts still run
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  if "$@"; then
    echo "== $name: ok in $((SECONDS - start)) s"
  else
    echo "== $name: FAILED (exit $?) after $((SECONDS - start)) s"
    failed+=("$name")
  fi
}

part "tests on $device" env TTA_TEST_DEVICE="$device" "$py" -m pytest -q -p no:cacheprovider \
  test/unit/test_cuda.py ${tests[@]+"${tests[@]}"}
if (( ! dry )); then  # the kernel tests marked cuda (their CPU tests run in the default suite)
  part "kernel tests marked cuda" "$py" -m pytest -q -p no:cacheprovider -m cuda \
    test/unit/test_kernels.py test/unit/test_kernels_triton.py
fi
part "latency: source / bn_adapt / tent / adashadow, one interleaved run" \
  "$py" benchmarks/speed/bench_paper_ratios.py --device "$device" --out "$out" "${ratios[@]}"
part "saved activations, step time, served forward, serving in fp32 and fp16" \
  "$py" benchmarks/gpu_figures.py --device "$device" --out "$out" ${figures[@]+"${figures[@]}"}
part "DAF kernels: Triton vs native" \
  "$py" benchmarks/speed/bench_kernels.py --device "$device" --out "$out" ${kernels[@]+"${kernels[@]}"}
part "DAF steps: dense, 8/4 bits, 12 % dynamic widths (time, CUDA peak)" \
  "$py" benchmarks/memory/bench_daf_device.py --device "$device" --out "$out" ${daf[@]+"${daf[@]}"}

if (( ${#failed[@]} )); then
  printf 'gpu_check.sh: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "== gpu_check.sh done"
