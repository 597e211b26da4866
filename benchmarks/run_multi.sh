#!/usr/bin/env bash
# One device session on N GPUs of one host (NVLink multicast off): FP8 gradient communication and tensor-parallel
# benchmarks. Usage (device tool): bash benchmarks/run_multi.sh N [gpt] [tp] [kernel-tests] [nosweep]
#   bash benchmarks/run_multi.sh 2                    1B-element reduction table with the sweep (bench_comm.py --sweep:
#                                                     kernel grids x slices x NCCL settings), about 2-3 minutes
#   bash benchmarks/run_multi.sh 2 gpt kernel-tests   + GPT DDP/FSDP2 steps, GPU kernel tests
#   bash benchmarks/run_multi.sh 4 tp nosweep         1B-element reduction table, TP=4 sequence-parallel layer
# Logs go to $OUT (comm_N.log, comm_stdout_N.txt, tp_N.txt, kernel_tests.txt); the tables are printed last.
# SKIP_INSTALL=1 skips the editable install (a second call in the same session).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
N=${1:-2}; shift; PARTS=" $* "; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; python3 -c "import torch, triton; \
print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"; } > "$OUT/env_$N.txt" 2>&1
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
fi
GPT_FLAG=--no-gpt; SWEEP=--sweep; COMM_T=${COMM_T:-300}
case "$PARTS" in *" gpt "*) GPT_FLAG=--gpt; COMM_T=${COMM_T_GPT:-330};; esac
case "$PARTS" in *" nosweep "*) SWEEP=;; esac
timeout "$COMM_T" torchrun --nproc-per-node "$N" benchmarks/bench_comm.py $GPT_FLAG $SWEEP --iters 10 \
  --log-file "$OUT/comm_$N.log" > "$OUT/comm_stdout_$N.txt" 2>&1
echo "bench_comm exit $?" >> "$OUT/comm_stdout_$N.txt"
case "$PARTS" in *" tp "*)
  timeout "${TP_T:-80}" torchrun --nproc-per-node "$N" benchmarks/bench_tp.py --iters 5 > "$OUT/tp_$N.txt" 2>&1
  echo "bench_tp exit $?" >> "$OUT/tp_$N.txt";;
esac
case "$PARTS" in *" kernel-tests "*)  # the compiled kernels against their references; a model on the second GPU
  timeout 150 python3 -m pytest -q -m gpu tests/distributed/test_comm_kernels.py tests/core/test_second_gpu.py \
    > "$OUT/kernel_tests.txt" 2>&1
  echo "kernel tests exit $?" >> "$OUT/kernel_tests.txt"; tail -2 "$OUT/kernel_tests.txt";;
esac
echo "=== $N GPUs"; cat "$OUT/env_$N.txt"
grep -E "Triton kernels|FAILED|exit" "$OUT/comm_stdout_$N.txt" | head -12
case "$PARTS" in *" tp "*) tail -8 "$OUT/tp_$N.txt";; esac
sed -n '/^what /,$p' "$OUT/comm_stdout_$N.txt" | grep -v "^log written\|exit"
