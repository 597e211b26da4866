"""The end-to-end benchmark (benchmarks/train_step.py) runs on CPU at toy size, so it never rots between GPU runs:
every variant trains (the loss falls) from the same initial loss as BF16 (same seed and weights, FP8 rounding
only), and the table of ratios is printed."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_train_step_toy_runs_every_variant(tmp_path):
    variants = ["bf16", "o1", "o2", "o2w", "o2m", "o2mf", "o2mh"]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--toy", "--variants", ",".join(variants),
           "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == sorted(variants)
    base = rows["bf16"]
    # A random-token model starts near ln(vocab) = ln(256).
    assert abs(base["first_loss"] - math.log(256)) < 0.2
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["params_m"] == base["params_m"]
        assert row["step_ms"] > 0 and row["tok_s"] > 0
        # FP8 rounding of the GEMM operands moves the first loss of a toy model by well under 1%.
        assert row["first_loss"] == pytest.approx(base["first_loss"], rel=1e-2), name
        assert row["last_loss"] < row["first_loss"], name  # it trains
    table = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["64x2", "o2w"] for line in table), proc.stdout[-2000:]


def test_train_step_toy_compiled_cast_variants(tmp_path):
    """The compiled variants that change how casts are made (o2fc: fused by inductor, lightning_fp8.scaling.FUSED_CASTS;
    o2ri: inputs cast again in the backward, lightning_fp8.matmul.SAVE_INPUT_TRANSPOSE_COMPILED; o2w: the weights'
    FP8 copies written by the optimizer, lightning_fp8/weight_cache.py) train a toy GPT with LayerNorms and GELUs as
    the default does: the same first (eager) step, losses within float noise after it, each compiled as one graph
    (a graph break or a recompile after the eager step would run part of the step eagerly)."""
    variants = ["o2", "o2fc", "o2ri", "o2w"]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--toy", "--compile", "yes", "--variants",
           ",".join(variants), "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    for name in variants:
        assert "error" not in rows[name], (name, rows[name])
        assert rows[name]["first_loss"] == rows["o2"]["first_loss"], name
        assert rows[name]["last_loss"] == pytest.approx(rows["o2"]["last_loss"], rel=1e-3), name
        assert rows[name]["last_loss"] < rows[name]["first_loss"], name
        assert (rows[name]["graph_breaks"], rows[name]["graphs"]) == (0, 1), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variants", "bf16,o2x"], "--variants: unknown ['o2x']"),  # ran as plain O2, named o2x
        (["--variants", "o3"], "--variants: unknown ['o3']; choose from bf16, torchao, o1, o2,"),  # an FP8Recipe error
        (["--sizes", "64x2,64"], "--sizes: ['64'] are not WIDTHxDEPTH"),
        (["--steps", "0"], "argument --steps"),
    ],
)
def test_train_step_bad_arguments_are_usage_errors(args, message):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--toy", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "error:" in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_train_step_flags_given_win_over_toy_defaults():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    def settings(argv):
        args = train_step.parse_args(argv)
        return args.sizes, args.seq, args.batch, args.vocab, args.steps, args.warmup, args.compile

    assert settings(["--toy"]) == ("64x2", 64, 2, 256, 2, 1, "no")
    assert settings([]) == ("1024x12,2048x16,4096x8", 2048, 8, 50304, 20, 5, "both")
    flags = ["--sizes", "32x1", "--seq", "16", "--batch", "3", "--steps", "4", "--warmup", "0", "--compile", "both"]
    # --toy replaced them all; now only the vocabulary, not given, is the toy's
    assert settings(["--toy", *flags]) == ("32x1", 16, 3, 256, 4, 0, "both")


def test_the_small_layer_variant_keeps_what_torchaos_tensorwise_filter_keeps():
    """``o2ma`` at d=1024: of each block's four linear layers only the MLP's down projection (4096 -> 1024) is FP8, as
    torchao's tensorwise auto filter decides from (out, in) (<= 4096 and <= 1024: kept); the head stays high precision
    as in every variant; at d=2048 every block's layer is FP8."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    import lightning_fp8 as lf

    for width, want in ((1024, ["blocks.0.mlp.proj"]), (2048, ["blocks.0.attn.proj", "blocks.0.attn.qkv",
                                                                "blocks.0.mlp.fc", "blocks.0.mlp.proj"])):  # fmt: skip
        model, _ = train_step.build("o2ma", width, 1, 16, 64, "cpu")
        fp8 = sorted(name for name, m in model.named_modules() if isinstance(m, lf.FP8Linear))
        assert fp8 == want, (width, fp8)


@pytest.mark.parametrize("script", ["memory_breakdown", "step_phases"])
def test_toy_defaults_leave_the_flags_given(script):
    # --toy used to overwrite --seq/--batch/--vocab (and step_phases' --steps/--compile-mode) after parsing
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = importlib.import_module(script)
    toy = module.parse_args(["--toy"])
    assert (toy.size, toy.seq, toy.batch, toy.vocab) == ("64x2", 64, 2, 256)
    full = module.parse_args([])
    assert (full.size, full.seq, full.batch, full.vocab) == ("2048x16" if script == "memory_breakdown" else "1024x12",
                                                             2048, 8, 50304)  # fmt: skip
    given = module.parse_args(["--toy", "--size", "32x1", "--seq", "16", "--batch", "3"])
    assert (given.size, given.seq, given.batch, given.vocab) == ("32x1", 16, 3, 256)
    if script == "step_phases":
        assert (toy.steps, toy.compile_mode, full.steps, full.compile_mode) == (2, "eager", 10, "default")
        given = module.parse_args(["--toy", "--steps", "5", "--compile-mode", "default"])
        assert (given.steps, given.compile_mode) == (5, "default")


def test_train_step_table_shows_a_toy_models_parameters():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    row = {"size": "64x2", "compiled": False, "step_ms": 1.0, "tok_s": 128.0, "peak_gib": math.nan, "last_loss": 5.5}
    rows = [{**row, "variant": "bf16", "params_m": 0.1234}, {**row, "variant": "o2", "params_m": 1234.4}]
    lines = train_step.table(rows).splitlines()
    assert lines[1].split()[3] == "0.12M" and lines[2].split()[3] == "1234M", lines  # was 0M for the toy model
    assert len({len(line) for line in lines}) == 1  # the columns still line up


def test_memory_breakdown_replays_the_allocator_trace():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_breakdown import by_line, live_at_peak

    def frame(name):
        return [{"filename": "/site-packages/torch/_tensor.py", "line": 1, "name": "x"},
                {"filename": f"/repo/lightning_fp8/{name}.py", "line": 7, "name": name}]  # fmt: skip

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frame("a")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frame("b")},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 70, "frames": frame("a")},
        {"action": "alloc", "addr": 4, "size": 40, "frames": frame("c")},  # 160: the peak
        {"action": "free_requested", "addr": 9, "size": 8},  # allocated before the trace began: not counted
        {"action": "free_requested", "addr": 4, "size": 40},
        {"action": "alloc", "addr": 5, "size": 30, "frames": []},  # 150
    ]
    peak, blocks = live_at_peak(trace)
    assert peak == 160
    assert sorted(size for size, _ in blocks) == [40, 50, 70]
    assert by_line(blocks) == [("a.py:7 a", 70), ("b.py:7 b", 50), ("c.py:7 c", 40)]


def test_memory_breakdown_toy_runs():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_breakdown.py"), "--toy", "--variants", "bf16,o2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = {line.split()[0]: line for line in proc.stdout.splitlines() if " vs bf16: " in line}
    assert sorted(ratios) == ["bf16", "o2"]
    # O2 keeps FP8 linear weights in 6 bytes against 16, and the forward saves FP8 copies of the linear inputs
    # (and weights) instead of bf16 ones: both below BF16's.
    static, saved = (float(ratios["o2"].split(f"{k} ")[1].split("x")[0]) for k in ("static", "activations"))
    assert static < 0.8 and saved < 1.0, ratios["o2"]
    assert "optimizer exp_avg torch.float8_e4m3fn" in proc.stdout


def test_bench_grad_cast_toy_runs():
    # The batched gradient casts against the per-tensor ones (bit for bit: the script asserts it), Triton under the
    # interpreter; the table is printed last.
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_grad_cast.py"), "--toy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "exact: batched and per-tensor casts give the same bits" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()[-2:]]
    assert [row[0] for row in rows] == ["per-tensor", "batched"], proc.stdout[-2000:]


def test_bench_step_casts_toy():
    """benchmarks/bench_step_casts.py at toy size on CPU: every cast of a block runs eagerly and compiled, and the two
    give the same FP8 bytes (the 'same' column)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step_casts.py"), "--toy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if "x" in line and ("True" in line or "False" in line)]
    assert len(rows) == 14, proc.stdout  # 6 activation and gradient casts, 4 weights, 4 recasts
    assert all("True" in row and "False" not in row for row in rows), proc.stdout


def test_bench_mlp_toy_runs():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_mlp.py"), "--toy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[:2] for r in rows] == [[w, v] for w in ("32", "64") for v in ("bf16", "fp8", "fp8mlp")]
    assert all(float(r[3]) > 0 for r in rows)


def test_step_phases_toy_runs():
    """benchmarks/step_phases.py at toy size on CPU: each phase of a BF16 and an O2 step is timed, and the step's wall
    time holds its phases' host times (on CPU every phase runs as it is called)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_phases.py"), "--toy", "--variants", "bf16,o2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[-2:]]
    assert [r[0] for r in rows] == ["bf16", "o2"], proc.stdout[-2000:]
    for row in rows:
        step, cells, host_sum = float(row[1]), row[2:6], float(row[6])
        host, alone = zip(*(tuple(float(v) for v in c.split("/")) for c in cells), strict=True)
        assert all(v > 0 for v in host + alone[:3]), row
        # Four phases and their sum, each printed to 2 decimals: up to 5 x 0.005 apart (0.02 was reached in CI).
        assert abs(host_sum - sum(host)) <= 0.025 + 1e-9 and step > 0.8 * host_sum, row


def test_kernel_trace_summary_counts_each_launch():
    """benchmarks/kernel_trace.py's report of a chrome trace: kernels in start order, busy time and span per step,
    casts grouped by (name, grid) with counts per step, and the idle gaps, against sums worked out by hand."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_trace

    def kernel(ts, dur, name, grid):
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"grid": grid, "block": [128, 1, 1]}}

    events = [  # two steps, listed out of order, with a CPU op that is not a kernel
        kernel(200.0, 30.0, "_cast_transpose_kernel", [1024, 1, 1]),
        {"cat": "cpu_op", "ts": 0.0, "dur": 999.0, "name": "aten::mm", "args": {}},
        kernel(0.0, 100.0, "nvjet_sm90_qqtst_128x256", [2, 66, 1]),
        kernel(100.0, 10.0, "_cast_transpose_kernel", [1024, 1, 1]),
        kernel(500.0, 50.0, "_cast_flat_kernel", [528, 1, 1]),
    ]
    rows = kernel_trace.kernel_rows(events)
    assert [r[0] for r in rows] == [0.0, 100.0, 200.0, 500.0]
    assert rows[1][3] == (1024, 1, 1)
    report = kernel_trace.summary(rows, steps=2).splitlines()
    # busy (100 + 10 + 30 + 50) / 2 = 95 us, span 550 / 2 = 275 us per step
    assert report[0] == "2 kernels/step, GPU busy 0.10 ms/step, span 0.28 ms/step"
    assert "fp8 gemm 0.05" in report[1] and "fp8 cast 0.04" in report[1]
    cast_1024 = next(line for line in report if line.startswith("_cast_transpose_kernel"))
    assert cast_1024.split()[-3:] == ["1.0", "0.02", "20.0"]  # 2 launches / 2 steps, 40 us / 2 steps, 20 us each
    # gaps over 20 us: 110 -> 200 (90 us) and 230 -> 500 (270 us)
    assert "idle gaps over 20 us: 1/step, 0.18 ms/step; largest:" in report


@pytest.mark.parametrize("variant", ["nockpt", "ckpt"])
def test_compile_magnitude_check_matches_eager_on_cpu(variant):
    """benchmarks/compile_magnitude_check.py (the repro of a torch 2.11 CUDA fault): on this CPU every step's gradients
    equal the eager layers' bit for bit across jumps of the input's magnitude."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compile_magnitude_check

    row = compile_magnitude_check._row(variant, "cpu")
    assert "!" not in row and "x0" not in row and row.count(":x=") == len(compile_magnitude_check.STEPS), row


def test_bench_comm_toy_runs_on_two_gloo_processes(tmp_path):
    # The docstring's CPU smoke test: the reductions, then the DDP and FSDP2 GPT steps (the DDP section built the
    # NCCL-only FP8CommState(algorithm="native") before skipping it on gloo, and died there).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_comm.py"), "--toy"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith(("DDP step", "FSDP2 step"))]
    for variant in ("auto", "portable", "gather"):
        assert sum(f"FP8 hook ({variant})" in line for line in steps) == 2, proc.stdout[-3000:]  # two bucket sizes
    assert not [line for line in steps if "native" in line]  # NCCL's only
    assert any("FP8 reduce_scatter" in line for line in steps)
    assert (tmp_path / "bench_comm_gloo_2.log").stat().st_size > 0


def test_bench_optim_toy_runs_and_says_memory_was_not_measured():
    """benchmarks/bench_optim.py --toy on CPU: the Triton step (interpreted) matches the reference bit for bit, and
    the memory lines say they were not measured (torch keeps no memory counters off CUDA; they printed 0.00 B/param)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_optim.py"), "--toy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    exact = [line for line in proc.stdout.splitlines() if "bit for bit" in line or "bit-exact" in line]
    assert exact and all("True" in line for line in exact), proc.stdout
    memory = [line for line in proc.stdout.splitlines() if "after backward" in line or "peak during" in line]
    assert len(memory) == 6, proc.stdout
    assert all("not measured" in line and "0.00 B/param" not in line for line in memory), proc.stdout


_NO_GPU = "GPU-only scripts are checked for their usage error without a GPU"


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # a variant or size the model builder does not know: a ValueError from the first child process or model
        # (FP8Recipe(opt_level='BO') for "bogus"), or an unpacking error, not a usage error naming the flag
        ("memory_breakdown.py", ["--toy", "--variants", "bogus"], "--variants: unknown ['bogus']"),
        ("step_phases.py", ["--toy", "--variants", "bf16,o3"], "--variants: unknown ['o3']"),
        ("step_phases.py", ["--size", "12"], "--size: ['12'] are not WIDTHxDEPTH"),
        ("kernel_trace.py", ["--size", "12"], "--size: ['12'] are not WIDTHxDEPTH"),
        ("profile_step.py", ["--what", "gpt", "--variants", "o9"], "--variants: unknown ['o9']"),
        # an unknown --what kind profiled nothing, with exit code 0
        ("profile_step.py", ["--what", "bogus"], "--what: unknown ['bogus']"),
        # an empty buffer (IndexError) or an unknown pass (KeyError)
        ("bench_comm_passes.py", ["--numel", "0"], "need 1 <= --tensors <= --numel"),
        ("bench_comm_passes.py", ["--iters", "0"], "need --iters >= 1"),
        # no argparse: --help was a traceback from CUDA or NCCL, or (check_compile.py) ran the checks
        ("compile_magnitude_check.py", ["gpu"], "argument device: invalid choice: 'gpu'"),
        ("check_compile.py", ["--bogus"], "unrecognized arguments: --bogus"),
        # counts below one: a ZeroDivisionError or an empty median after the model was built, a negative layer
        # count building nothing, or (--sum-groups 0) a Triton launch error
        ("bench_cast.py", ["--toy", "--sum-groups", "0"], "argument --sum-groups: must be an integer >= 1, got 0"),
        ("bench_grad_cast.py", ["--toy", "--layers", "-1"], "argument --layers: must be an integer >= 1, got -1"),
        ("bench_step_casts.py", ["--toy", "--width", "0"], "argument --width: must be an integer >= 1, got 0"),
        ("memory_breakdown.py", ["--toy", "--seq", "0"], "argument --seq: must be an integer >= 1, got 0"),
        ("step_phases.py", ["--toy", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        ("bench_comm.py", ["--toy", "--iters", "0"], "argument --iters: must be an integer >= 1, got 0"),
        ("bench_comm.py", ["--toy", "--numel", "2.5"], "argument --numel: must be a whole number >= 1"),
        ("bench_comm.py", ["--toy", "--sweep-programs", "-1"], "argument --sweep-programs: must be an integer >= 0"),
        ("bench_optim.py", ["--toy", "--iters", "0"], "argument --iters: must be an integer >= 1, got 0"),
        ("bench_tp.py", ["--toy", "--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
        ("bench_linear.py", ["--toy", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
        ("bench_mlp.py", ["--toy", "--tokens", "0"], "argument --tokens: must be an integer >= 1, got 0"),
        ("host_overhead.py", ["--iters", "0"], "argument --iters: must be an integer >= 1, got 0"),
        ("kernel_trace.py", ["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        ("profile_step.py", ["--rows", "-3"], "argument --rows: must be an integer >= 1, got -3"),
    ],
)
def test_benchmark_bad_arguments_are_usage_errors(script, args, message):
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "error:" in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "script",
    ["bench_transpose.py", "inductor_readback_race.py", "bench_comm_caps.py", "compile_magnitude_check.py",
     "check_compile.py", "kernel_trace.py", "profile_step.py"],
)  # fmt: skip
def test_benchmark_help_shows_the_docstring(script):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout[-1000:] + proc.stderr[-2000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason=_NO_GPU)
@pytest.mark.parametrize(
    "script", ["bench_transpose.py", "inductor_readback_race.py", "bench_comm_caps.py", "kernel_trace.py"]
)
def test_gpu_only_benchmarks_say_so_without_a_gpu(script):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
