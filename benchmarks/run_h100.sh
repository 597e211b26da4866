#!/usr/bin/env bash
# One device session on an H100: install, GPU tests, then the single-GPU benchmarks. Logs under $OUT.
# Usage (device tool, carry .whl for torchao): bash benchmarks/run_h100.sh [linear|train|optim|lab ...]
# Compile caches: copy the icache.tgz.part-* files a call returns into a git-ignored folder, carry it, and run with
# CACHE_IN=that/folder.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; } > "$OUT/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt"
# Compile caches across calls (each call may start a fresh machine, where compiling one FP8 GPT variant took
# 160-200 s): inductor's and Triton's (eagerly launched Triton kernels compile into TRITON_CACHE_DIR, by default outside inductor's folder).
# CACHE_IN: a carried folder holding the icache.tgz.part-* files an earlier call left under $OUT.
export TORCHINDUCTOR_CACHE_DIR=/tmp/icache/inductor TRITON_CACHE_DIR=/tmp/icache/triton
if [ -n "${CACHE_IN:-}" ] && ls "$CACHE_IN"/icache.tgz.part-* > /dev/null 2>&1; then
  cat "$CACHE_IN"/icache.tgz.part-* | tar xz -C /tmp
fi
# CACHE_OUT=0: keep the caches on the machine only (a warm machine's next call still finds them under /tmp).
[ "${CACHE_OUT:-1}" = 1 ] && trap 'tar czf - -C /tmp icache 2> /dev/null | split -b 15M - "$OUT/icache.tgz.part-"' EXIT
for what in "$@"; do
  case $what in
    check) timeout 200 python3 benchmarks/check_compile.py > "$OUT/check_compile.log" 2>&1; tail -4 "$OUT/check_compile.log";;
    gputests) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gputests.log" 2>&1; tail -4 "$OUT/gputests.log";;
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/core/test_linear.py tests/core/test_scaling.py > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log";;
    linear) timeout 240 python3 benchmarks/bench_linear.py --compile > "$OUT/linear.log" 2>&1; tail -8 "$OUT/linear.log";;
    cast) timeout 60 python3 benchmarks/bench_cast.py > "$OUT/cast.log" 2>&1; tail -9 "$OUT/cast.log";;
    optim) timeout 200 python3 benchmarks/bench_optim.py --iters 10 --out "$OUT/optim_h100.txt" > "$OUT/optim.log" 2>&1; tail -16 "$OUT/optim.log";;
    train) timeout 420 python3 benchmarks/train_step.py --compile no --variants ${VARIANTS:-bf16,torchao,o1,o2} --steps 10 --warmup 3 --json "$OUT/train_step.json" > "$OUT/train_step.log" 2>&1; tail -14 "$OUT/train_step.log";;
    train_compile) timeout 540 python3 benchmarks/train_step.py --compile yes --steps 10 --warmup 3 --json "$OUT/train_step_compile.json" > "$OUT/train_step_compile.log" 2>&1; tail -14 "$OUT/train_step_compile.log";;
    linear_eager) for i in 1 2; do timeout 150 python3 benchmarks/bench_linear.py > "$OUT/linear_eager_$i.log" 2>&1; tail -4 "$OUT/linear_eager_$i.log"; done;;
    host) timeout 60 python3 benchmarks/host_overhead.py > "$OUT/host.log" 2>&1; tail -6 "$OUT/host.log";;
    gputests_core) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/core > "$OUT/gputests.log" 2>&1; tail -3 "$OUT/gputests.log";;
    transpose) timeout 60 python3 benchmarks/bench_transpose.py > "$OUT/transpose.log" 2>&1; tail -4 "$OUT/transpose.log";;
    train_emit) timeout 200 python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile no --variants bf16,o2,o2w --steps 10 --warmup 3 > "$OUT/train_emit.log" 2>&1; tail -5 "$OUT/train_emit.log";;
    train_graphs) timeout 400 python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile yes --compile-mode reduce-overhead --variants bf16,o2 --steps 10 --warmup 3 --timeout 190 > "$OUT/train_graphs.log" 2>&1; tail -4 "$OUT/train_graphs.log";;
    # Session 4: the casts traced as triton_ops under torch.compile, and the fp16 transpose path of the cast.
    gputests_compile) timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cast.py tests/core/test_linear.py -k "(every_variant and fp32) or custom_ops or inductor or traced_quantize or tma" > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log";;
    castsweep) timeout 90 python3 benchmarks/bench_cast.py --sweep --save-configs "$OUT/configs.json" > "$OUT/cast_sweep.log" 2>&1; tail -12 "$OUT/cast_sweep.log";;
    linear_compile) timeout 120 python3 benchmarks/bench_linear.py --compile --shapes ${SHAPES:-0} $([ -f "$OUT/configs.json" ] && echo --configs "$OUT/configs.json") > "$OUT/linear_compile.log" 2>&1; tail -5 "$OUT/linear_compile.log";;
    train_c) timeout 230 python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile yes --variants ${VARIANTS:-bf16,o2} --steps 8 --warmup 3 --timeout 115 > "$OUT/train_c.log" 2>&1; tail -4 "$OUT/train_c.log";;
    memory) timeout 300 python3 benchmarks/memory_breakdown.py --size ${SIZES:-2048x16} --variants bf16,o2 > "$OUT/memory.log" 2>&1; tail -30 "$OUT/memory.log";;
    # Session 5: the compiled step with the traced casts on by default, and its profile.
    train_c2) timeout ${T:-380} python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile yes --variants ${VARIANTS:-bf16,o2} --steps 8 --warmup 3 --timeout ${TC:-280} --json "$OUT/train_c2.json" > "$OUT/train_c2.log" 2>&1; tail -4 "$OUT/train_c2.log";;
    profile_c) timeout ${TP:-200} python3 benchmarks/profile_step.py --what gpt --compile --width ${W:-1024} --depth ${D:-12} --variants ${PVARIANTS:-o2} --rows 25 > "$OUT/profile_c.log" 2>&1; grep "===" "$OUT/profile_c.log";;
    profile_e) timeout ${TP:-200} python3 benchmarks/profile_step.py --what gpt --width ${W:-2048} --depth ${D:-16} --variants ${PVARIANTS:-bf16,o2} --rows 25 > "$OUT/profile_e.log" 2>&1; grep "===" "$OUT/profile_e.log";;
    memory2) for s in ${MSIZES:-4096x8 2048x16}; do timeout 170 python3 benchmarks/memory_breakdown.py --size $s --variants bf16,o2 > "$OUT/memory_$s.log" 2>&1; tail -3 "$OUT/memory_$s.log"; done;;
    gputests_recast) timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_linear.py tests/kernels/test_cast.py -k "recast or inductor or (every_variant and fp32)" > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log";;
    # Session 6: the cast's statistics modes and persistent grid swept finely; FP8Linear with the swept configs.
    s6cast) timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cast.py -k "(every_variant and fp32) or statistics_mode" > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
            timeout 140 python3 benchmarks/bench_cast.py --sweep --save-configs "$OUT/configs.json" > "$OUT/cast_sweep.log" 2>&1; tail -16 "$OUT/cast_sweep.log"
            timeout 200 python3 benchmarks/bench_linear.py --breakdown --configs "$OUT/configs.json" > "$OUT/linear.log" 2>&1; tail -12 "$OUT/linear.log";;
    s6confirm) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cast.py tests/core/test_linear.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
               timeout 60 python3 benchmarks/bench_cast.py > "$OUT/cast.log" 2>&1; tail -12 "$OUT/cast.log"
               timeout 200 python3 benchmarks/bench_linear.py --compile > "$OUT/linear_1.log" 2>&1; tail -8 "$OUT/linear_1.log"
               timeout 120 python3 benchmarks/bench_linear.py > "$OUT/linear_2.log" 2>&1; tail -4 "$OUT/linear_2.log";;
    s6spec) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cast.py tests/core/test_linear.py tests/core/test_scaling.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
            timeout 60 python3 benchmarks/bench_cast.py > "$OUT/cast.log" 2>&1; tail -16 "$OUT/cast.log"
            for i in 1 2; do timeout 120 python3 benchmarks/bench_linear.py > "$OUT/linear_$i.log" 2>&1; tail -10 "$OUT/linear_$i.log"; done
            timeout 100 python3 benchmarks/profile_step.py --what linear,linear_bf16 --rows 30 > "$OUT/profile_linear.log" 2>&1; grep "===" "$OUT/profile_linear.log";;
    s6grad) timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_grad_cast_kernels.py tests/core/test_grad_cast.py tests/core/test_optim.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
            timeout 60 python3 benchmarks/bench_grad_cast.py > "$OUT/grad_cast.log" 2>&1; tail -8 "$OUT/grad_cast.log"
            timeout 230 python3 benchmarks/train_step.py --sizes 1024x12 --compile yes --variants bf16,o2 --steps 8 --warmup 3 --timeout 110 --json "$OUT/train_1024.json" > "$OUT/train_1024.log" 2>&1; tail -3 "$OUT/train_1024.log"
            timeout 150 python3 benchmarks/profile_step.py --what gpt --compile --width 1024 --depth 12 --variants o2 --rows 25 > "$OUT/profile_c.log" 2>&1; grep "===" "$OUT/profile_c.log";;
    # Session 7: replayed cast launches (kernels/launch.py Replay) and the weight recast without zeroed accumulators.
    s7a) timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_cast.py tests/core/test_linear.py tests/core/test_optim.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
         timeout 60 python3 benchmarks/host_overhead.py --cprofile > "$OUT/host.log" 2>&1; tail -4 "$OUT/host.log"
         for i in 1 2; do timeout 120 python3 benchmarks/bench_linear.py > "$OUT/linear_$i.log" 2>&1; tail -10 "$OUT/linear_$i.log"; done
         timeout 110 python3 benchmarks/train_step.py --sizes 1024x12 --compile no --variants bf16,o2 --steps 8 --warmup 3 > "$OUT/train_eager.log" 2>&1; tail -3 "$OUT/train_eager.log";;
    s7b) timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_cast.py tests/core/test_linear.py tests/core/test_optim.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
         timeout 60 python3 benchmarks/host_overhead.py > "$OUT/host.log" 2>&1; tail -4 "$OUT/host.log"
         for i in 1 2; do timeout 120 python3 benchmarks/bench_linear.py > "$OUT/linear_$i.log" 2>&1; tail -10 "$OUT/linear_$i.log"; done;;
    s7train) timeout ${T:-330} python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile yes --variants ${VARIANTS:-bf16,o2} --steps 8 --warmup 3 --timeout ${TC:-160} --json "$OUT/train.json" > "$OUT/train.log" 2>&1; tail -4 "$OUT/train.log"
             timeout ${TP:-100} python3 benchmarks/profile_step.py --what linear,linear_bf16 --rows 30 > "$OUT/profile_linear.log" 2>&1; grep "===" "$OUT/profile_linear.log";;
    s7c) for i in 1 2; do timeout 150 python3 benchmarks/bench_linear.py --graphs > "$OUT/linear_$i.log" 2>&1; tail -13 "$OUT/linear_$i.log"; done
         timeout 100 python3 benchmarks/profile_step.py --what linear,linear_bf16 --rows 30 > "$OUT/profile_linear.log" 2>&1; grep "===" "$OUT/profile_linear.log";;
    s7d) timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_cast.py tests/core/test_linear.py tests/core/test_optim.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
         timeout 100 python3 benchmarks/bench_cast.py --small > "$OUT/cast_small.log" 2>&1; grep -A8 "^current-scaled" "$OUT/cast_small.log"
         timeout 130 python3 benchmarks/bench_linear.py > "$OUT/linear_1.log" 2>&1; tail -13 "$OUT/linear_1.log"
         timeout 60 python3 benchmarks/bench_linear.py --shapes 0 > "$OUT/linear_2.log" 2>&1; tail -5 "$OUT/linear_2.log";;
    # Session 8: the bias gradient fused into the grad cast, summed over row groups of GROUP_M tiles in registers.
    s8a) timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_cast.py tests/core/test_linear.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
         timeout 60 python3 benchmarks/bench_cast.py --shape 16384 4096 --fp8 e5m2 --sum-groups ${SUMG:-1 2 4 8 16} > "$OUT/cast_4096.log" 2>&1; grep -A30 "^fused bias" "$OUT/cast_4096.log"
         timeout 60 python3 benchmarks/bench_cast.py --shape 16384 16384 --fp8 e5m2 --sum-groups ${SUMG:-1 2 4 8 16} > "$OUT/cast_16384.log" 2>&1; grep -A30 "^fused bias" "$OUT/cast_16384.log"
         for i in 1 2; do timeout 130 python3 benchmarks/bench_linear.py > "$OUT/linear_$i.log" 2>&1; tail -13 "$OUT/linear_$i.log"; done;;
    s8b) timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_cast.py tests/core/test_linear.py tests/core/test_optim.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
         for i in 1 2 3; do timeout 100 python3 benchmarks/bench_linear.py > "$OUT/linear_$i.log" 2>&1; tail -13 "$OUT/linear_$i.log"; done;;
    s6final) timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_grad_cast.py tests/kernels/test_cast.py -k "grad_cast or speculative or (every_variant and fp32)" > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
             timeout 330 python3 benchmarks/train_step.py --sizes 1024x12 --compile yes --variants bf16,o2 --steps 8 --warmup 3 --timeout 160 --json "$OUT/train_1024.json" > "$OUT/train_1024.log" 2>&1; tail -3 "$OUT/train_1024.log"
             timeout 130 python3 benchmarks/profile_step.py --what gpt --compile --width 1024 --depth 12 --variants o2 --rows 25 > "$OUT/profile_c.log" 2>&1; grep "===" "$OUT/profile_c.log";;
    s6train) for s in ${SIZES:-4096x8 2048x16}; do timeout 290 python3 benchmarks/train_step.py --sizes $s --compile yes --variants bf16,o2 --steps 8 --warmup 3 --timeout 200 --json "$OUT/train_$s.json" > "$OUT/train_$s.log" 2>&1; tail -3 "$OUT/train_$s.log"; done;;
    # Session 14 (not run: no device after run 3): the weights' FP8 copies under torch.compile, tested on the GPU, then
    # timed at d=1024 (o2m against o2mw, BF16 in the same call; compiling an FP8 variant there takes 160-200 s).
    s14emit) timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_weight_cache.py tests/core/test_linear.py > "$OUT/gputests.log" 2>&1; echo "gputests rc=$?" >> "$OUT/gputests.log"; tail -2 "$OUT/gputests.log"
             timeout 440 python3 benchmarks/train_step.py --sizes ${SIZES:-1024x12} --compile yes --variants bf16,o2m,o2mw --steps 8 --warmup 3 --timeout 210 --json "$OUT/train_emit_c.json" > "$OUT/train_emit_c.log" 2>&1; tail -4 "$OUT/train_emit_c.log";;
    # Session 22 (H200): the end-to-end table, one train_step.py call per size in SIZES, the variants in VARIANTS.
    e2e) for s in ${SIZES:-2048x16}; do timeout ${T:-570} python3 benchmarks/train_step.py --sizes $s --compile yes --variants ${VARIANTS:-bf16,torchao,o2m,o2mh} --steps ${STEPS:-8} --warmup 3 --timeout ${TC:-280} --json "$OUT/train_$s.json" > "$OUT/train_$s.log" 2>&1; tail -5 "$OUT/train_$s.log"; done;;
  esac
done
