#!/usr/bin/env bash
# The CUDA checks, as one prepared run for a session that is lent a GPU machine for a few minutes
# (CI never has one; nothing depends on this). It uses the machine's own python3 and torch and installs
# nothing: the library needs only torch (the launcher's Hydra tests are not run here).
#
#   bash benchmarks/cuda_session.sh            # writes $OUT (the device tool's output folder) or ./cuda-out
#
# What it runs, each bounded so that the whole ends in about 8 minutes on one H200:
#   1. the tests marked `cuda` (tests/conftest.py skips them without a device): device peaks vs the plan,
#      offload, budget:auto on the device's free memory;
#   2. the memory benchmark on CUDA (benchmarks/memory.py: peak from torch.cuda.max_memory_allocated,
#      wall time), fewer timed rounds than its default;
#   3. benchmarks/offload_cuda.py where it exists (host-link bandwidth against recompute, offload plans).
# Copy the .md/.png files it writes into benchmarks/results/ and the figures into the README by hand:
# check them first (they are measurements of a torch that may not be the pinned one).
set -u
out=${OUT:-cuda-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
py=${PYTHON:-python3}
{ nvidia-smi -L; "$py" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$out/env.txt" 2>&1
timeout 150 "$py" -m pytest -q -rs -m cuda -p no:cacheprovider tests/unit > "$out/cuda_tests.log" 2>&1
echo "pytest rc=$?" >> "$out/cuda_tests.log"
timeout 240 "$py" -m benchmarks.memory --device cuda --rounds 8 --out "$out" > "$out/memory.log" 2>&1
echo "memory rc=$?" >> "$out/memory.log"
if [ -f benchmarks/offload_cuda.py ]; then
    timeout 120 "$py" -m benchmarks.offload_cuda --out "$out" > "$out/offload.log" 2>&1
    echo "offload rc=$?" >> "$out/offload.log"
fi
tail -n 3 "$out"/*.log
