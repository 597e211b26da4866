#!/usr/bin/env bash
# The Accelerate FSDP2 example on the GPUs of one host: train with FP8-LM, save_state, resume.
set -eu
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1
cfg=examples/accelerate/fsdp2.yaml; script=examples/accelerate/train_gpt.py
timeout 200 lightning-fp8 launch --config_file $cfg $script --preset small --steps 30 --save-every 15 --log-every 5 --out /tmp/a 2>&1 | grep -v Warning | tee "$OUT/fsdp2_train.txt" | tail -25
timeout 150 lightning-fp8 launch --config_file $cfg $script --preset small --steps 20 --log-every 5 --resume /tmp/a/checkpoint_15 --out /tmp/b 2>&1 | grep -v Warning | tee "$OUT/fsdp2_resume.txt" | tail -12
