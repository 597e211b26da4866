"""The examples run, at toy size, and learn: train_gpt.py (Lightning, FP8-LM), lab.py (BF16 vs FP8), the
Accelerate loop's data and validation, corpus.py's data.

The scripts run in subprocesses exactly as a user runs them; each test then checks what they wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from cli import text_path  # noqa: E402
from corpus import ByteWindows, load_corpus  # noqa: E402
from gpt import GPT, GPTConfig, fp8_module_filter  # noqa: E402
from lab_report import summary_table, verdicts  # noqa: E402

UNIFORM_LOSS = math.log(256)  # cross-entropy of a model that learned nothing about bytes
# After a few dozen steps a byte-level GPT has learned at least the character frequencies of Python source
# (unigram entropy ~3.4 nats/byte is far below ln 256 = 5.5): require a clear drop, not a tuned value.
LEARNED_LOSS = UNIFORM_LOSS - 1.5
# FP8 rounding (E4M3 ~6% per value, averaged over a GEMM) moves a toy model's loss by well under 1% in our
# runs; 5% still catches broken scaling (which costs tens of percent or diverges).
FP8_VS_BF16_REL = 0.05
# A bf16 model loaded from the FP8 run's checkpoint sees the same weights; the FP8 rounding of activations
# that it no longer does moves the loss by about as much as FP8 vs BF16 training.
BF16_INFERENCE_REL = 0.05
TOY = ["--width", "64", "--depth", "2", "--heads", "4", "--seq-len", "64", "--batch-size", "8"]
# lab.py flags under which it neither trains nor writes, even with a bad flag accepted: a usage error either way
LAB_NO_RUN = ["--report-only", "--out", "/nonexistent/lab"]


def _run(script: str, args: list[str], timeout: float, **env_vars: str) -> subprocess.CompletedProcess:
    """Run an example as a user does; ``timeout`` only guards against a hang."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _assert_learned(losses: list[float]) -> None:
    assert all(math.isfinite(v) for v in losses), "non-finite training loss"
    k = max(3, len(losses) // 8)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < first - 0.5, f"training loss did not decrease: first {first:.3f}, last {last:.3f}"


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=3_000_000)


def test_corpus_split_is_deterministic_and_disjoint(corpus):
    again = load_corpus(max_bytes=3_000_000)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert corpus.train.dtype == torch.uint8 and corpus.val.numel() > 10_000
    # Whole files are held out: a 64-byte window of validation text essentially never occurs in training.
    train_bytes = bytes(corpus.train.tolist())
    val_bytes = bytes(corpus.val.tolist())
    probes = [val_bytes[i : i + 64] for i in range(1000, len(val_bytes) - 64, len(val_bytes) // 20)]
    assert sum(p in train_bytes for p in probes) <= len(probes) // 4


def test_user_data_file(tmp_path):
    text = "".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(2000)).encode()
    (tmp_path / "notes.txt").write_bytes(text)
    c = load_corpus(tmp_path / "notes.txt")
    assert c.files == 1 and c.train.numel() + c.val.numel() == len(text)
    assert bytes(c.val.tolist()) == text[c.train.numel() :]  # one file: its tail is the validation split
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        load_corpus(tmp_path / "missing")


def test_a_directory_whose_files_all_hash_into_validation_splits_its_tail(tmp_path):
    """An unlucky split of a directory leaves the tail to validation whichever split got no file: with every file held
    out, 136 KB of text was refused as too short to train on ("0 training bytes: give about 2048 bytes")."""
    names = [n for n in (f"f{i}.txt" for i in range(50)) if zlib.crc32(n.encode()) % 10_000 < 5_000][:3]
    for name in names:
        (tmp_path / name).write_text("".join(f"line {i} of {name}: some text\n" for i in range(1500)))
    c = load_corpus(tmp_path, val_fraction=0.5)
    assert c.files == 3 and c.train.numel() > 60_000 and c.val.numel() > 60_000


def test_a_directory_whose_held_out_files_are_small_splits_its_tail(tmp_path):
    """Which files hash into validation depends on the directory: on Python 3.10's standard library the default
    examples' first 100 KB held out one 64-byte file, and every example refused to start ("64 validation bytes, but
    each split needs at least 1024"). A split leaving either side under 1024 bytes takes the tail instead."""
    train_names = [n for n in (f"t{i}.txt" for i in range(50)) if zlib.crc32(n.encode()) % 10_000 >= 500][:4]
    val_name = next(n for n in (f"v{i}.txt" for i in range(500)) if zlib.crc32(n.encode()) % 10_000 < 500)
    for name in train_names:
        (tmp_path / name).write_text("".join(f"line {i} of {name}: some text\n" for i in range(500)))
    (tmp_path / val_name).write_text("a short file\n")
    c = load_corpus(tmp_path, val_fraction=0.05)
    text = b"\n".join((tmp_path / name).read_bytes() for name in sorted([*train_names, val_name]))
    assert c.files == 5 and c.train.numel() + c.val.numel() == len(text)
    assert c.val.numel() >= 1024 and bytes(c.val.tolist()) == text[c.train.numel() :]


def test_a_directory_with_a_broken_link_and_a_named_pipe_reads_its_files(tmp_path):
    """os.walk lists links and pipes among the files: a broken link was a FileNotFoundError traceback, and a named pipe
    blocked the read forever (a subprocess, so that such a hang fails the test instead of stopping the suite)."""
    (tmp_path / "a.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(2000)))
    (tmp_path / "broken.txt").symlink_to(tmp_path / "missing.txt")
    os.mkfifo(tmp_path / "pipe")
    code = f"from corpus import load_corpus; print(load_corpus({str(tmp_path)!r}, val_fraction=0.3).files)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr[-2000:]


def test_a_directory_without_text_and_an_empty_file_get_load_corpus_own_errors(tmp_path):
    # torch.frombuffer's "both buffer length (0) and count (-1) must not be 0" came first.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "data.bin").write_bytes(b"\0\1\2" * 100)
    for folder in (tmp_path / "bin", tmp_path / "bin" / "nothing"):
        folder.mkdir(exist_ok=True)
        with pytest.raises(ValueError, match="found no text file there"):
            load_corpus(folder)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="into 0 training and 0 validation bytes.*give more text"):
        load_corpus(tmp_path / "empty.txt")


@pytest.mark.parametrize(("size", "val_fraction"), [(20_000, 0.05), (20_480, 0.05), (1_500, 0.5), (1_500, 0.9)])
def test_small_corpus_errors_say_which_split_is_short_and_what_to_do(tmp_path, size, val_fraction):
    (tmp_path / "one.txt").write_bytes(b"z" * size)
    # Reference: one file's last val_fraction of bytes is the validation split; each split needs 1024 bytes.
    n_train = int(size * (1 - val_fraction))
    n_val = size - n_train
    short = [name for name, n in (("training", n_train), ("validation", n_val)) if n < 1024]
    if not short:
        c = load_corpus(tmp_path / "one.txt", val_fraction=val_fraction)
        assert (c.train.numel(), c.val.numel()) == (n_train, n_val)
        return
    with pytest.raises(ValueError) as info:
        load_corpus(tmp_path / "one.txt", val_fraction=val_fraction)
    message = str(info.value)
    assert f"{n_train} training and {n_val} validation bytes" in message and "at least 1024" in message
    assert f"too few: {' and '.join(short)}" in message and "give more text" in message
    hints = {("validation",): ["raise val_fraction"], ("training",): ["lower val_fraction"]}.get(tuple(short), [])
    assert [h for h in ("raise val_fraction", "lower val_fraction") if h in message] == hints
    # the text it asks for is enough
    (tmp_path / "one.txt").write_bytes(b"z" * int(message.split("about ")[1].split(" bytes")[0]))
    c = load_corpus(tmp_path / "one.txt", val_fraction=val_fraction)
    assert min(c.train.numel(), c.val.numel()) >= 1024


def test_max_bytes_is_an_upper_bound(tmp_path):
    """max_bytes bounds what is read: files were read whole and the bound checked after (a 39.5 KB file with
    max_bytes=5000 gave all of it; the stdlib with 100000 gave 328 KB)."""
    text = "".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(1300)).encode()
    (tmp_path / "big.txt").write_bytes(text)
    c = load_corpus(tmp_path / "big.txt", max_bytes=5000, val_fraction=0.5)
    assert c.train.numel() + c.val.numel() == 5000
    assert bytes(c.train.tolist()) + bytes(c.val.tolist()) == text[:5000]  # the file's first 5000 bytes
    small, large = load_corpus(max_bytes=100_000), load_corpus(max_bytes=1_000_000)
    for c, max_bytes in ((small, 100_000), (large, 1_000_000)):  # many files: the joining newlines count too
        assert max_bytes - 1000 < c.train.numel() + c.val.numel() <= max_bytes
    # files are read in order, the last one cut: a smaller bound gives a prefix of a larger one's text
    assert torch.equal(small.train[:50_000], large.train[:50_000])


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_data_path_is_refused(value):
    """``--data "$UNSET"`` trained on the current directory (Path("") is "."): now a usage error."""
    with pytest.raises(argparse.ArgumentTypeError, match="empty .*unset shell variable"):
        text_path(value)


def test_missing_path_error_names_the_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"load_corpus\(path=.*missing.*neither a file nor a directory") as info:
        load_corpus(tmp_path / "missing")
    assert "--data" not in str(info.value)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_windows_reject_a_bad_seq_len(seq_len):
    with pytest.raises(ValueError, match="seq_len"):
        ByteWindows(torch.arange(10, dtype=torch.uint8), seq_len)


def test_windows_and_model_shapes(corpus):
    ds = ByteWindows(corpus.train, 48)
    x, y = ds[5]
    assert x.shape == y.shape == (48,) and torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    cfg = GPTConfig(seq_len=48, depth=2, width=48, heads=3)
    logits, loss = GPT(cfg)(x[None], y[None])
    assert logits.shape == (1, 48, 256) and abs(loss.item() - UNIFORM_LOSS) < 0.5


def test_config_errors():
    with pytest.raises(ValueError, match="width must be a multiple of heads"):
        GPTConfig(width=100, heads=3)
    with pytest.raises(ValueError, match="depth=0"):
        GPTConfig(depth=0)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")


def test_module_filter_keeps_head_out_of_fp8():
    from lightning_fp8 import convert_to_fp8, fp8_modules

    model = convert_to_fp8(GPT(GPTConfig(depth=2, width=64)), module_filter_fn=fp8_module_filter)
    names = set(fp8_modules(model))
    assert names == {f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert model.lm_head.weight is model.wte.weight  # still tied


def test_train_gpt_says_gemms_are_emulated_only_for_fp8_precisions(monkeypatch):
    import train_gpt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_gpt.describe_device("fp8-lm") == "CPU (FP8 GEMMs emulated)"
    assert train_gpt.describe_device("fp8-lm-e4m3") == "CPU (FP8 GEMMs emulated)"
    for precision in ("bf16-mixed", "16-mixed", "32-true"):  # no FP8 GEMM in these runs, emulated or not
        assert train_gpt.describe_device(precision) == "CPU"


def test_train_gpt_toy(tmp_path):
    out = tmp_path / "run"
    steps, val_batches = 60, 4
    args = [*TOY, "--max-steps", str(steps), "--val-every", "30", "--val-batches", str(val_batches), "--lr", "3e-3"]
    proc = _run("train_gpt.py", [*args, "--out", str(out), "--no-progress-bar"], timeout=900)
    assert "final train loss" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "fp8-lm" and summary["steps"] == steps
    _assert_learned(summary["train_losses"])
    assert summary["final_val_loss"] < LEARNED_LOSS
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert list((out / "csv").glob("version_*/metrics.csv"))

    # The checkpoint loads with weights_only=True into a plain (never converted) GPT run in bf16, and that
    # model scores the validation windows the script validated on about as the FP8 run did.
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    model = GPT(GPTConfig(**ckpt["hyper_parameters"]["gpt"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    model = model.to(torch.bfloat16).eval()
    val = ByteWindows(load_corpus().val, model.cfg.seq_len)
    batch = [val[i] for i in range(val_batches * 8)]
    with torch.no_grad():
        _, loss = model(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
    assert loss.item() == pytest.approx(summary["final_val_loss"], rel=BF16_INFERENCE_REL)


def test_lab_toy(tmp_path):
    out = tmp_path / "lab"
    args = [*TOY, "--seq-len", "32", "--max-steps", "40", "--val-every", "20", "--val-batches", "3", "--lr", "3e-3"]
    _run("lab.py", [*args, "--out", str(out)], timeout=900)
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
    assert set(runs) == {"bf16", "fp8-lm", "fp8-lm-o1", "torchao"}
    for name in ("bf16", "fp8-lm", "fp8-lm-o1"):
        r = runs[name]
        assert r["status"] == "ok", r["status"]
        _assert_learned(r["series"]["train_loss"])
        assert r["final_val_loss"] < LEARNED_LOSS and r["nonfinite_losses"] == 0
        assert [step for step, _ in r["series"]["val"]] == [20, 40]
    for name in ("fp8-lm", "fp8-lm-o1"):
        assert runs[name]["final_val_loss"] == pytest.approx(runs["bf16"]["final_val_loss"], rel=FP8_VS_BF16_REL)
        scales = runs[name]["series"]["log2_scales"]
        assert len(scales) == 8 and all(set(roles) == {"input", "weight", "grad_output"} for roles in scales.values())
        assert runs[name]["series"]["grad_scale"], "the gradient scale mu was not recorded"
    # Parameter + optimizer states of the FP8 linear weights (DESIGN.md's table without the gradient): fp32
    # weight, m, v = 12 bytes for BF16 and O1; fp16 master + E4M3 m + fp16 v = 5 bytes (+ 0-dim scales) at O2.
    # The 0-dim scalars (step counts, scales) add a few bytes per tensor: under 0.01 bytes per parameter here.
    assert runs["bf16"]["linear_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert runs["fp8-lm-o1"]["linear_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert runs["fp8-lm"]["linear_bytes_per_param"] == pytest.approx(5.0, abs=0.01)
    if runs["torchao"]["status"].startswith("skipped"):
        assert "not installed" in runs["torchao"]["status"]
    for name in ("summary.md", "loss.png", "throughput.png", "memory.png", "scales_fp8-lm.png", "health_fp8-lm.png"):
        assert (out / name).stat().st_size > 0, name
    summary = (out / "summary.md").read_text()
    assert "| FP8-LM O2 | ok |" in summary and "relative to BF16" in summary


def test_train_plain_toy(tmp_path):
    args = [*TOY, "--max-steps", "60", "--val-batches", "4", "--lr", "3e-3", "--out", str(tmp_path)]
    proc = _run("train_plain.py", args, timeout=900)
    losses = [float(line.split("| loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "| loss " in line]
    final = next(line for line in proc.stdout.splitlines() if line.startswith("final train loss"))
    val_loss = float(final.split("final val loss ")[1].split()[0])
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5 and val_loss < LEARNED_LOSS
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert set(ckpt) == {"model", "fp8", "optimizer", "grad_scaler"}
    assert any(key.endswith("grad_output.amax_history") for key in ckpt["fp8"])


def test_train_plain_without_fp8_layers_logs_no_scales(tmp_path):
    """A width that is not a multiple of 16 is a valid GPT whose linear layers all stay in high precision (documented);
    the log line read the grad_output scales of FP8 layers there were none of (a KeyError at the first log)."""
    args = ["--width", "24", "--heads", "2", "--depth", "1", "--seq-len", "32", "--batch-size", "4", "--max-steps", "1"]
    proc = _run("train_plain.py", [*args, "--max-bytes", "100000", "--val-batches", "1", "--out", str(tmp_path)], 300)
    assert "| grad_output scales none" in proc.stdout and "final val loss" in proc.stdout


def test_train_plain_a_save_cut_short_leaves_the_earlier_checkpoint(tmp_path, monkeypatch):
    """torch.save wrote checkpoint.pt in place: a save that failed part-way (a full disk, a kill) left half a file
    where the earlier run's checkpoint was."""
    import train_plain

    (tmp_path / "checkpoint.pt").write_bytes(b"the earlier checkpoint")

    def save_half(obj, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half)
    args = ["--width", "32", "--heads", "2", "--depth", "1", "--seq-len", "32", "--batch-size", "4", "--max-steps", "1"]
    with pytest.raises(OSError, match="No space left"):
        train_plain.main([*args, "--max-bytes", "100000", "--val-batches", "1", "--out", str(tmp_path)])
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"the earlier checkpoint"


def test_hf_trainer_resumes_from_a_checkpoint_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """examples/hf_trainer.py: transformers.Trainer's checkpoints lack the FP8 scaling state; its FP8StateCallback
    saves and loads it, so the resumed run's weights are the uninterrupted run's bit for bit (without the load they
    differed by ~5e-3 after 4 more steps)."""
    pytest.importorskip("transformers")
    import hf_trainer

    full = hf_trainer.train(8, str(tmp_path / "full"), save_steps=4)
    checkpoint = tmp_path / "full" / "checkpoint-4"
    assert (checkpoint / hf_trainer.state_file(0)).is_file() and not list(checkpoint.glob("*.partial"))
    resumed = hf_trainer.train(8, str(tmp_path / "resumed"), resume=str(checkpoint), save_steps=4)
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    monkeypatch.setattr(hf_trainer.FP8StateCallback, "on_train_begin", lambda *args, **kwargs: None)
    fresh_scales = hf_trainer.train(8, str(tmp_path / "fresh"), resume=str(checkpoint), save_steps=4)
    pairs = zip(full.parameters(), fresh_scales.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)  # not vacuous
    (checkpoint / hf_trainer.state_file(0)).unlink()
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="saved without FP8StateCallback"):
        hf_trainer.train(8, str(tmp_path / "missing"), resume=str(checkpoint), save_steps=4)


@pytest.mark.parametrize("steps", [2, 1])
def test_hf_trainer_resume_at_or_past_steps_is_a_usage_error(tmp_path, capsys, steps):
    """transformers checks max_steps after a step: resumed from checkpoint-2 with --steps 2 it trained step 3 and wrote
    checkpoint-3, though --steps counts the run's steps in all."""
    import hf_trainer

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / hf_trainer.state_file(0)).write_bytes(b"")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 2}))
    with pytest.raises(SystemExit) as exit_info:
        hf_trainer.main(["--steps", str(steps), "--out", str(tmp_path / "run"), "--resume", str(checkpoint)])
    assert exit_info.value.code == 2 and "is at step 2 already: give a --steps above it" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("script", "args", "flag"),
    [
        ("train_gpt.py", ["--max-steps", "0"], "--max-steps"),
        ("train_gpt.py", ["--val-every", "0"], "--val-every"),
        ("train_gpt.py", ["--warmup-steps", "-1"], "--warmup-steps"),
        ("train_plain.py", ["--max-steps", "0"], "--max-steps"),
        ("train_plain.py", ["--val-batches", "-2"], "--val-batches"),
        ("lab.py", ["--batch-size", "0"], "--batch-size"),
        ("lab_report.py", [], "lab_dir"),
        ("train_plain.py", ["--recipe", "fp8-lmm"], "--recipe"),
        ("train_plain.py", ["--width", "48", "--heads", "5"], "width must be a multiple of heads"),
        ("train_gpt.py", ["--width", "48", "--heads", "5"], "width must be a multiple of heads"),
        ("train_gpt.py", ["--precision", "bogus", "--max-bytes", "60000"], "--precision 'bogus'"),
        # Lightning's list of precisions leaves out the FP8-LM ones this script is about
        ("train_gpt.py", ["--precision", "fp8lm", "--max-bytes", "60000"], "or one of this package's fp8-lm,"),
        ("accelerate/train_gpt.py", ["--log-every", "0"], "--log-every"),
        ("accelerate/train_gpt.py", ["--grad-accum", "0"], "--grad-accum"),
        ("accelerate/train_gpt.py", ["--preset", "tiny"], "--preset"),
        ("accelerate/train_gpt.py", ["--width", "48", "--heads", "5"], "width must be a multiple of heads"),
        # a --data path that is not there: named in a usage error, not load_corpus's FileNotFoundError
        ("train_gpt.py", ["--data", "/nonexistent/corpus"], "argument --data: '/nonexistent/corpus'"),
        ("train_plain.py", ["--data", "/nonexistent/corpus"], "argument --data: '/nonexistent/corpus'"),
        ("lab.py", ["--data", "/nonexistent/corpus", *LAB_NO_RUN], "argument --data: '/nonexistent/corpus'"),
        # learning rates torch.optim refuses at fit time (-1, nan) or takes silently (inf): refused at parse time
        ("train_gpt.py", ["--lr", "-1"], "argument --lr"),
        ("train_plain.py", ["--lr", "-0.5"], "argument --lr"),
        ("train_plain.py", ["--lr", "inf"], "argument --lr"),
        ("lab.py", ["--lr", "-1", *LAB_NO_RUN], "argument --lr"),
        ("train_gpt.py", ["--seed", "-1"], "argument --seed"),  # Lightning's seed_everything raised
        ("accelerate/train_gpt.py", ["--weight-decay", "-0.1"], "argument --weight-decay"),
        # --clip -1 turned clipping off silently (the help says 0 does)
        ("accelerate/train_gpt.py", ["--clip", "-1"], "argument --clip"),
        ("accelerate/train_gpt.py", ["--resume", "/nonexistent/checkpoint"], "--resume '/nonexistent/checkpoint'"),
        ("train_gpt.py", ["--resume", "/nonexistent/last.ckpt"], "argument --resume: '/nonexistent/last.ckpt'"),
        # --data "$UNSET" trained on the current directory
        ("lab.py", ["--data", "", *LAB_NO_RUN], "argument --data: '' is empty"),
        ("accelerate/train_gpt.py", ["--data", " "], "argument --data: ' ' is empty"),
        ("accelerate/train_gpt.py", ["--data", "/nonexistent/corpus"], "argument --data: '/nonexistent/corpus'"),
        # the flag that load_corpus's "raise/lower val_fraction" advice names, in every script taking --data
        ("train_gpt.py", ["--val-fraction", "1"], "argument --val-fraction"),
        ("train_plain.py", ["--val-fraction", "0"], "argument --val-fraction"),
        ("lab.py", ["--val-fraction", "-0.1", *LAB_NO_RUN], "argument --val-fraction"),
        ("accelerate/train_gpt.py", ["--val-fraction", "nan"], "argument --val-fraction"),
        ("accelerate/train_gpt.py", ["--val-every", "0"], "argument --val-every"),
        # a data error of the Accelerate loop: argparse's exit 2, as in the other scripts (was exit 1)
        ("accelerate/train_gpt.py", ["--seq-len", "100000", "--max-bytes", "60000"], "fewer than one batch"),
        # an --out that is a file: mkdir's traceback after the data was loaded and the model built
        ("train_gpt.py", ["--out", __file__], "argument --out"),
        ("train_plain.py", ["--out", __file__], "argument --out"),
        ("lab.py", ["--out", __file__], "argument --out"),
        ("accelerate/train_gpt.py", ["--out", __file__], "argument --out"),
        ("hf_trainer.py", ["--out", __file__], "argument --out"),
        ("train_gpt.py", ["--out", ""], "argument --out: '' is empty"),
        # a folder that is no save_state checkpoint: load_state's FileNotFoundError after metrics.jsonl was written
        ("accelerate/train_gpt.py", ["--resume", str(EXAMPLES)], "is not a checkpoint folder written by save_state"),
        # transformers reads max_steps <= 0 as "train 3 epochs": --steps 0 and -1 trained without a word
        ("hf_trainer.py", ["--steps", "0"], "argument --steps"),
        ("hf_trainer.py", ["--steps", "-1"], "argument --steps"),
        ("hf_trainer.py", ["--save-steps", "0"], "argument --save-steps"),
        # a missing or foreign --resume folder: transformers' ValueError / the callback's FileNotFoundError, late
        ("hf_trainer.py", ["--resume", "/nonexistent/checkpoint-40"], "--resume '/nonexistent/checkpoint-40'"),
        ("hf_trainer.py", ["--resume", str(EXAMPLES)], "holds no lightning_fp8_state_rank0.pt"),
    ],
)
def test_bad_arguments_are_usage_errors(script, args, flag):
    # Not a traceback from deep inside the run (ZeroDivisionError, FileNotFoundError): argparse's exit 2 naming it.
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr and flag in proc.stderr


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformer_engine") is not None, reason="transformer-engine is installed"
)
def test_a_precision_whose_package_is_missing_is_a_usage_error_with_the_install_command():
    """--precision transformer-engine without the package was a ModuleNotFoundError traceback from Lightning."""
    args = ["--precision", "transformer-engine", "--max-bytes", "60000"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--precision 'transformer-engine'" in proc.stderr and "pip install transformer-engine" in proc.stderr


def test_val_fraction_reaches_the_split(tmp_path):
    """The file of the too-short test below: with --val-fraction 0.5 its validation split holds batches."""
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i}: some text to train on\n" for i in range(800)))
    args = [*TOY, "--data", str(text), "--val-fraction", "0.5", "--max-steps", "2", "--val-batches", "1"]
    proc = _run("train_gpt.py", [*args, "--out", str(tmp_path / "run"), "--no-progress-bar"], timeout=600)
    assert "0.01 MB validation" in proc.stdout  # half of ~25 KB


def _lab_run(variant: str, final_val_loss: float) -> dict:
    return {
        "variant": variant, "label": variant.upper(), "status": "ok", "final_val_loss": final_val_loss,
        "final_train_loss": 1.0, "tokens_per_sec": 1000.0, "peak_memory_gib": None, "linear_bytes_per_param": 5.0,
        "bytes_per_param": 6.0, "skipped_steps": 0, "nonfinite_losses": 0, "health_events": [],
    }  # fmt: skip


def test_lab_report_says_diverged_and_n_a_not_nan_and_dash_x():
    """A diverged run's verdict read "+nan%", a table without a BF16 run "-x"."""
    diverged = [_lab_run("bf16", 1.0), _lab_run("fp8-lm", math.nan)]
    table, lines = "\n".join(summary_table(diverged)), "\n".join(verdicts(diverged))
    assert "nan" not in table + lines and "| FP8-LM | ok | - | diverged | 1.0000 | 1,000 | 1.00x |" in table
    assert "FP8-LM: diverged (its final validation loss is not finite): NOT within 1%" in lines
    alone = "\n".join(summary_table([_lab_run("fp8-lm", 1.0)]))
    assert "x |" not in alone.replace("1.00x", "") and "| FP8-LM | ok | 1.0000 | n/a | 1.0000 | 1,000 | n/a |" in alone


def test_lab_report_help_and_an_empty_directory(tmp_path):
    helped = subprocess.run([sys.executable, str(EXAMPLES / "lab_report.py"), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "lab_dir" in helped.stdout
    empty = subprocess.run(
        [sys.executable, str(EXAMPLES / "lab_report.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert empty.returncode == 2 and "no runs in" in empty.stderr and "Traceback" not in empty.stderr
    # lab.py --report-only on a folder without runs: the same usage error, and nothing created there
    out = tmp_path / "no_lab"
    lab = subprocess.run(
        [sys.executable, str(EXAMPLES / "lab.py"), "--report-only", "--out", str(out)], capture_output=True, text=True
    )
    assert lab.returncode == 2 and "no runs in" in lab.stderr and "Traceback" not in lab.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--width", "128"], "--width"),
        (["--max-steps", "5", "--variants", "bf16", "--compile"], "--compile, --max-steps, --variants"),
        (["--seed", "1234"], "--seed"),  # its default, given: still a flag the report would not use
    ],
)
def test_lab_report_only_refuses_training_flags(tmp_path, capsys, flags, named):
    """--report-only rebuilds the report from --out's runs and trains nothing: a training flag beside it was silently
    ignored (the report of `--report-only --max-steps 5` was that of the runs as they were)."""
    import lab

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bf16.json").write_text(json.dumps(_lab_run("bf16", 1.0)))
    assert lab.parse_args(["--report-only", "--out", str(tmp_path)]).report_only
    with pytest.raises(SystemExit) as exit_info:
        lab.parse_args([*flags, "--report-only", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--report-only rebuilds the report from {tmp_path}'s runs" in err
    assert f"it does not use {named}; give --report-only with --out alone" in err


def test_lab_a_variant_failing_without_a_message_keeps_the_others(tmp_path, monkeypatch):
    """A variant's exception without a message (a bare assert) failed the handler meant to keep the other variants'
    results (IndexError: str(err).splitlines() is empty), and no report was written."""
    import lab

    def run_variant(name, args, loaders):
        if name == "fp8-lm":
            raise AssertionError  # what a bare `assert` raises outside pytest's rewritten modules
        return {**_lab_run(name, 1.0), "series": {"steps": [1], "train_loss": [1.0], "val": [], "scale_steps": []}}

    monkeypatch.setattr(lab, "run_variant", run_variant)
    lab.main([*TOY, "--max-bytes", "100000", "--variants", "fp8-lm,bf16", "--out", str(tmp_path)])
    failed = json.loads((tmp_path / "runs" / "fp8-lm.json").read_text())
    assert failed["status"] == "failed: AssertionError: " and (tmp_path / "runs" / "bf16.json").is_file()
    assert "| FP8-LM O2 | failed: AssertionError:  |" in (tmp_path / "summary.md").read_text()


def test_lab_report_names_a_half_written_run_file(tmp_path):
    """A runs/<variant>.json cut short (lab.py killed while writing it: it now writes a .partial and renames it) was
    a JSONDecodeError traceback from every later report, naming no file."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "fp8-lm.json").write_text('{"variant": "fp8-lm", "status": "o')
    for cmd in (["lab_report.py", str(tmp_path)], ["lab.py", "--report-only", "--out", str(tmp_path)]):
        proc = subprocess.run([sys.executable, str(EXAMPLES / cmd[0]), *cmd[1:]], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "fp8-lm.json is not a lab run" in proc.stderr and "run its variant again" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--width", "48", "--heads", "5"], "width must be a multiple of heads"),
        (["--seq-len", "100000", "--max-bytes", "60000"], "fewer than one batch of --batch-size"),
    ],
)
def test_lab_model_and_data_errors_are_usage_errors_before_anything_is_written(tmp_path, args, message):
    """As in train_gpt.py: a model or data that cannot be is argparse's exit 2, and --out is not created."""
    out = tmp_path / "lab"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "lab.py"), *args, "--max-steps", "2", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr and message in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("script", ["train_plain.py", "train_gpt.py"])
def test_a_corpus_too_short_for_one_validation_batch_is_a_usage_error_before_training(tmp_path, script):
    """load_corpus takes a 25 KB file, whose validation split (about 1250 bytes) holds fewer windows than one batch:
    the loaders (drop_last) gave no batch, and the final validation failed after training (ZeroDivisionError,
    IndexError). Now the script stops first, saying what to change."""
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i}: some text to train on\n" for i in range(800)))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--data", str(text), "--batch-size", "16", "--out", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "the validation split" in proc.stderr, proc.stderr[-2000:]
    assert "fewer than one batch of --batch-size 16" in proc.stderr


def test_lab_one_step_records_bytes_per_param(tmp_path):
    """A one-step lab run records the optimizer's bytes per parameter (it was taken at step 2 only, and a run of
    one step reported none): 5 bytes per linear weight at O2 (fp16 master, E4M3 m, fp16 v)."""
    out = tmp_path / "lab"
    args = [*TOY, "--seq-len", "32", "--max-steps", "1", "--val-batches", "1", "--variants", "fp8-lm"]
    _run("lab.py", [*args, "--out", str(out)], timeout=900)
    run = json.loads((out / "runs" / "fp8-lm.json").read_text())
    assert run["status"] == "ok" and run["series"]["steps"] == [1]
    assert run["linear_bytes_per_param"] == pytest.approx(5.0, abs=0.01)
    assert run["bytes_per_param"] > run["linear_bytes_per_param"]  # embeddings and norms keep fp32 AdamW states


def test_train_gpt_resumes_from_its_checkpoint(tmp_path):
    """--resume continues a run from last.ckpt: 2 steps, then on to 4."""
    out = tmp_path / "run"
    args = [*TOY, "--max-bytes", "200000", "--val-every", "2", "--val-batches", "1", "--no-progress-bar"]
    _run("train_gpt.py", [*args, "--max-steps", "2", "--out", str(out)], timeout=600)
    ckpt = out / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    _run("train_gpt.py", [*args, "--max-steps", "4", "--out", str(out), "--resume", str(ckpt)], timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["train_losses"]) == 2  # steps 3 and 4 only
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4


def _fake_train_gpt_checkpoint(path: Path, step: int = 2, width: int = 64, fp8_moments: bool = True) -> str:
    """The entries of a train_gpt.py checkpoint that --resume checks, for the TOY model (no run needed)."""
    from dataclasses import asdict

    gpt = asdict(GPTConfig.preset("toy", width=width, depth=2, heads=4, seq_len=64))
    moments = {"exp_avg": torch.zeros(2, dtype=torch.float8_e4m3fn), "exp_avg_scale": torch.tensor(64.0)}
    state = {0: {"step": torch.tensor(2.0), **(moments if fp8_moments else {"exp_avg": torch.zeros(2)})}}
    hparams = {"gpt": gpt, "lr": 2e-3, "warmup_steps": 10}
    checkpoint = {"global_step": step, "hyper_parameters": hparams, "optimizer_states": [{"state": state}]}
    torch.save(checkpoint, path)
    return str(path)


@pytest.mark.parametrize(
    ("checkpoint", "args", "message"),
    [
        # Lightning trained nothing, then the summary divided by zero (no loss since the resume)
        ({}, ["--max-steps", "2"], "is at step 2 already: give a --max-steps above it"),
        ({"step": 5}, ["--max-steps", "4"], "is at step 5 already"),
        # a size-mismatch traceback from load_state_dict
        ({"width": 128}, ["--max-steps", "4"], "resume with the run's --preset/--width"),
        # torch's AdamW read FP8AdamW's stored m * scale as m, without a word
        ({}, ["--max-steps", "4", "--precision", "bf16-mixed"], "holds FP8AdamW's moments"),
        ({}, ["--max-steps", "4", "--precision", "32-true"], "adamw_state_dict"),
        # Lightning restored the checkpoint's learning rate: --lr was recorded in the hyper-parameters, not trained with
        ({}, ["--max-steps", "4", "--lr", "0.05"], "goes on with its own learning rate 0.002"),
    ],
)
def test_train_gpt_resume_checkpoints_it_cannot_continue_are_usage_errors(tmp_path, capsys, checkpoint, args, message):
    import train_gpt

    ckpt = _fake_train_gpt_checkpoint(tmp_path / "last.ckpt", **checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.main([*TOY, *args, "--resume", ckpt, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_gpt_resume_takes_a_converted_or_bf16_checkpoint_and_refuses_a_file_that_is_none(tmp_path):
    """What the docs say works: an FP8 checkpoint converted with adamw_state_dict resumes in bf16, a bf16 checkpoint
    in FP8 (docs/guides/checkpoints.md). A file torch.load cannot read is a usage error (was the unpickler's
    KeyError traceback)."""
    import train_gpt

    converted = _fake_train_gpt_checkpoint(tmp_path / "a.ckpt", fp8_moments=False)
    for precision in ("bf16-mixed", "fp8-lm"):
        args = train_gpt.parse_args([*TOY, "--max-steps", "4", "--precision", precision, "--resume", converted])
        args.lr = 0.01  # another device's default, not given: the run trains with the checkpoint's, and records it
        train_gpt.check_resume(args, train_gpt.gpt_config(args), train_gpt.FP8_PRECISIONS)
        assert args.lr == 2e-3 and args.warmup_steps == 10  # not 5% of --max-steps (1)
    args = train_gpt.parse_args(
        [*TOY, "--max-steps", "4", "--lr", "0.002", "--warmup-steps", "3", "--resume", converted]
    )
    train_gpt.check_resume(
        args, train_gpt.gpt_config(args), train_gpt.FP8_PRECISIONS
    )  # its own lr given again; a new warm-up, which trains
    assert args.warmup_steps == 3
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    args = train_gpt.parse_args([*TOY, "--max-steps", "4", "--resume", str(junk)])
    with pytest.raises(ValueError, match="does not load .*give a .ckpt file this script wrote"):
        train_gpt.check_resume(args, train_gpt.gpt_config(args), train_gpt.FP8_PRECISIONS)


def test_accelerate_toy_with_own_data_and_validation(tmp_path):
    """The Accelerate loop takes --data, evaluates the held-out split every --val-every steps and at the end
    (val/loss in metrics.jsonl, printed), with FP8-LM from the environment, in one process."""
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(3000)))
    out = tmp_path / "run"
    args = ["--depth", "2", "--width", "64", "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--warmup", "2"]
    args += ["--data", str(text), "--steps", "5", "--log-every", "1", "--val-every", "2", "--val-batches", "2"]
    env = {"LIGHTNING_FP8_RECIPE": "fp8-lm", "LIGHTNING_FP8_EXCLUDE": "lm_head", "OMP_NUM_THREADS": "1"}
    proc = _run("accelerate/train_gpt.py", [*args, "--out", str(out)], timeout=600, **env)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {row["step"]: row["val/loss"] for row in rows if "val/loss" in row}
    assert sorted(val) == [2, 4, 5] and all(math.isfinite(v) and v < UNIFORM_LOSS + 0.5 for v in val.values())
    assert sorted(row["step"] for row in rows if row["step"]) == [1, 2, 3, 4, 5]  # one row per step
    assert f"data: {text} (1 files" in proc.stdout and f"final val loss {val[5]:.4f}" in proc.stdout
    assert "optimizer: FP8AdamW" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "2"], "is at step 2 already: give a --steps above it"),
        (["--steps", "1"], "is at step 2 already: give a --steps above it"),
        # load_state restored the saved hyper-parameters: --lr 0.05 was logged in the config, training used 0.001
        (["--steps", "3", "--lr", "0.05"], "goes on with its own --lr 0.001, not 0.05: leave --lr out"),
        (["--steps", "3", "--weight-decay", "0"], "goes on with its own --weight-decay 0.2, not 0.0"),
    ],
)
def test_accelerate_resume_it_cannot_continue_is_a_usage_error(tmp_path, capsys, args, message):
    """Resumed at --steps already, the loop trained nothing, saved checkpoint_final again and printed "final loss nan,
    final val loss nan"; a new --lr or --weight-decay was silently not trained with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerate_train_gpt", EXAMPLES / "accelerate" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    checkpoint = tmp_path / "checkpoint_2"
    checkpoint.mkdir()
    (checkpoint / "random_states_0.pkl").write_bytes(b"")
    torch.save({"step": 2, "batches": 2}, checkpoint / "custom_checkpoint_0.pkl")
    torch.save({"base_lrs": [0.001, 0.001], "last_epoch": 2}, checkpoint / "scheduler.bin")
    torch.save({"state": {}, "param_groups": [{"weight_decay": 0.2, "params": []}]}, checkpoint / "optimizer.bin")
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(2000)))
    data = ["--seq-len", "32", "--batch-size", "4", "--data", str(text), "--resume", str(checkpoint)]
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args([*data, *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    resumed = example.parse_args([*data, "--steps", "3"])[0]
    assert (resumed.lr, resumed.weight_decay) == (0.001, 0.2)  # the checkpoint's, not the defaults
    fresh = example.parse_args([*data[:-2], "--steps", "3"])[0]
    assert (fresh.lr, fresh.weight_decay) == (2e-3, 0.1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "8"], "goes on with its own --batch-size 4, not 8: leave --batch-size out"),
        (["--grad-accum", "1"], "goes on with its own --grad-accum 2, not 1: leave --grad-accum out"),
    ],
)
def test_accelerate_resume_with_another_batch_size_or_grad_accum_is_a_usage_error(tmp_path, capsys, args, message):
    """The saved step and data position count micro-batches of the run's --batch-size and --grad-accum: resumed with
    others, the run went on at another place in the data and schedule, silently. A checkpoint written before the sizes
    were saved (no batch_size or grad_accum in its TrainState) still resumes, with the flags' sizes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerate_train_gpt", EXAMPLES / "accelerate" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(2000)))

    def checkpoint(name: str, **train_state: int) -> list[str]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "random_states_0.pkl").write_bytes(b"")
        torch.save({"step": 2, "batches": 4, **train_state}, folder / "custom_checkpoint_0.pkl")
        return ["--seq-len", "32", "--data", str(text), "--steps", "3", "--resume", str(folder)]

    saved = checkpoint("checkpoint_2", batch_size=4, grad_accum=2)
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args([*saved, *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    resumed = example.parse_args(saved)[0]
    assert (resumed.batch_size, resumed.grad_accum) == (4, 2)  # the checkpoint's, not the defaults
    example.parse_args([*saved, "--batch-size", "4", "--grad-accum", "2"])  # its own sizes given again: fine
    older = example.parse_args([*checkpoint("older"), *args])[0]  # flags hold: nothing saved to check them against
    assert (older.batch_size, older.grad_accum) == ((8, 1) if "--batch-size" in args else (16, 1))
    state = example.TrainState(batch_size=4, grad_accum=2)
    assert state.state_dict() == {"step": 0, "batches": 0, "batch_size": 4, "grad_accum": 2}
    state.load_state_dict({"step": 2, "batches": 4})  # an older checkpoint's TrainState loads
    assert (state.step, state.batches) == (2, 4)


def test_accelerate_validation_leaves_the_end_of_a_training_epoch_synchronized():
    """A validation mid-epoch reads its whole (prepared) loader: one left half-read stayed the loader whose end
    Accelerate's accumulate() watches, so the last micro-batches of the epoch were not synchronized (they spilled into
    the next epoch, and only in epochs that held a validation: a resumed run diverged)."""
    import importlib.util

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    spec = importlib.util.spec_from_file_location("accelerate_train_gpt", EXAMPLES / "accelerate" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = torch.nn.Linear(4, 4)
    data = TensorDataset(torch.randn(10, 4), torch.randn(10, 4))
    try:
        accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
        val = example.validation_loader(DataLoader(data, batch_size=1, drop_last=True), batches=2)
        loader, val = accelerator.prepare(DataLoader(data, batch_size=1), val)

        class WithLoss(torch.nn.Module):  # as the example's GPT: (output, loss)
            def forward(self, x, y):
                return None, torch.nn.functional.mse_loss(model(x), y)

        mse = WithLoss()

        synced = []
        for i, _ in enumerate(loader):
            with accelerator.accumulate(model):
                synced.append(accelerator.sync_gradients)
            if i == 1:
                assert len(val) == 2 and torch.isfinite(example.evaluate(mse, val))
        assert synced == [False, False, False, True, False, False, False, True, False, True]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
