#!/usr/bin/env bash
# Every check that needs a GPU, as one command for a lent CUDA machine (about 8 minutes):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# It runs from the source tree, without installing: the machine's python3 needs torch with CUDA,
# pytest, pytest-timeout and lightning (pytest's warning filters name a Lightning warning).
# polars is needed only by the run-directory rows; wheels in .whl/ are installed first if there
# (see the device notes for fetching polars for another machine), else those rows are skipped.
#
# Writes into OUT_DIR (default $OUT, else ./gpu-check):
#   machine.txt      torch, CUDA and the GPU
#   tests.log        tests/test_cuda.py and the deterministic-mode CUDA reducer test
#   paired-gpt.md    benchmarks/paired.py on the GPT workload: plain, unsampled and sampled steps
#                    in one process, the unsampled step's fixed cost, peak CUDA memory
#   overhead-gpt.md  benchmarks/overhead.py on the GPT workload, one process per row
# The exit status is 1 if any part failed or timed out; every part runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python3 - <<'PY' 2>&1 | tee "$out/machine.txt" || exit 1
import torch

assert torch.cuda.is_available(), "CUDA is not available"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY

status=0
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_reducers.py::test_cuda_matches_cpu_in_deterministic_mode 2>&1 \
  | tee "$out/tests.log" || status=1

timeout 150 python3 benchmarks/paired.py --device cuda --workload gpt --rounds 12 \
  --sink recording 2>&1 | tee "$out/paired-gpt.md" || status=1

rows=baseline,ours-unsampled,ours-every-recording
if python3 -c "import polars" 2>/dev/null; then
  rows="$rows,ours-every-rundir,ours-every10-rundir"
fi
timeout 300 python3 benchmarks/overhead.py --device cuda --workloads gpt --rows "$rows" \
  --repeats 2 --output "$out/overhead-gpt.md" 2>&1 | tail -n 40 || status=1
exit "$status"
