#!/usr/bin/env bash
# One device session on N GPUs of one host (NVLink multicast off): FP8 gradient communication and tensor-parallel
# benchmarks. Usage (device tool): bash benchmarks/run_multi.sh N
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
N=${1:-2}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } > "$OUT/env.txt"
python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
timeout 200 torchrun --nproc-per-node "$N" benchmarks/bench_comm.py --no-gpt --iters 5 --log-file "$OUT/comm_$N.log" > "$OUT/comm_stdout_$N.txt" 2>&1
tail -22 "$OUT/comm_stdout_$N.txt"
timeout 150 torchrun --nproc-per-node "$N" benchmarks/bench_tp.py --iters 5 > "$OUT/tp_$N.txt" 2>&1
tail -14 "$OUT/tp_$N.txt"
