#!/bin/bash
# The `-m gpu` tests on one GPU machine (what CPU CI skips), in three parallel pytest processes; logs under $OUT.
# On the device machine: `bash benchmarks/run_gpu_tests.sh` (T: seconds per group, default 480).
set -u
OUT=${OUT:-gpu_tests_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1
T=${T:-480}
group() {
    name=$1
    shift
    (timeout "$T" python3 -m pytest -q -p no:randomly -m gpu "$@" > "$OUT/$name.log" 2>&1; echo "rc $?" >> "$OUT/$name.log") &
}
group a tests/core/test_compiled_function_outputs.py tests/core/test_linear.py tests/core/test_default_device.py \
    tests/core/test_triton_paths.py tests/core/test_pre_ada_gpus.py
group b tests/core/test_layer_checkpointing.py tests/core/test_scaling.py tests/core/test_layer_first_casts.py
group c tests/core/test_mlp.py tests/core/test_clip_fp8_grads.py tests/core/test_optim_release.py \
    tests/core/test_optim_o1_grads.py tests/core/test_grad_cast.py tests/core/test_weight_cache.py tests/kernels \
    tests/distributed
wait
cat "$OUT/gpu.txt"
for f in a b c; do echo "== $f"; grep -E "passed|failed|error|FAILED|rc " "$OUT/$f.log" | tail -8; done
