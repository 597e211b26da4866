#!/usr/bin/env bash
# The Accelerate example with Accelerate's tensor-parallel config on 2 GPUs of one host (TP=2, sequence parallel,
# FP8 activation communication): train with FP8-LM, save_state, resume; then the same example under DDP.
set -eu
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1
launch="lightning-fp8 launch --multi_gpu --num_processes 2 --mixed_precision bf16 --parallelism_config_tp_size 2"
script=examples/accelerate/train_gpt.py
timeout 200 $launch --fp8-tp-plan gpt $script --preset small --steps 30 --save-every 15 --log-every 5 --out /tmp/a 2>&1 \
  | grep -v Warning | tee "$OUT/tp_train.txt" | tail -25
timeout 150 $launch --fp8-tp-plan gpt $script --preset small --steps 30 --log-every 5 --resume /tmp/a/checkpoint_15 --out /tmp/b 2>&1 \
  | grep -v Warning | tee "$OUT/tp_resume.txt" | tail -12
ls -R /tmp/a/checkpoint_15 | head -20 | tee "$OUT/tp_checkpoint_files.txt"
# The same example under plain DDP (2 GPUs): the FP8 gradient all-reduce hook and FP8AdamW on a replicated model.
timeout 150 lightning-fp8 launch --multi_gpu --num_processes 2 --mixed_precision bf16 $script --preset small --steps 30 --log-every 5 --out /tmp/c 2>&1 \
  | grep -v Warning | tee "$OUT/ddp_train.txt" | tail -10
