"""A Hugging Face transformers model (tiny Llama, built from a config: no download) converted and trained, run with
the README's test command from the checkout's root, where the repository's ``kernels/`` folder shadowed the
``kernels`` distribution transformers imports (every model import failed: "cannot import name 'CUDAProperties' from
'kernels'")."""

import copy
import importlib.machinery
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8
from tests.numerics import FORWARD_SQNR_DB, sqnr

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _installed_kernels() -> str | None:
    """Where an installed ``kernels`` distribution lives (not this checkout's folder), or None."""
    path = [p for p in sys.path if Path(os.path.abspath(p or os.curdir)) != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    return spec.origin if spec is not None and spec.loader is not None else None


def test_import_kernels_in_the_checkout_root_gives_the_installed_distribution():
    installed = _installed_kernels()
    if installed is None:
        pytest.skip("no 'kernels' distribution installed (transformers < 5 does not need one)")
    code = "import kernels; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == installed, out
    # lightning_fp8's kernels are still its own
    code = "import kernels, lightning_fp8.kernels as k; print(k.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ROOT / "kernels" / "__init__.py"), out


def test_import_kernels_with_the_checkout_on_sys_path_twice(tmp_path):
    """The checkout reached by two spellings (a link on PYTHONPATH, the current directory): the folder found itself
    again under the other one and stepped aside for it, back and forth (RecursionError)."""
    (tmp_path / "link").symlink_to(ROOT, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "link")}
    code = "import kernels; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    installed = _installed_kernels()
    if installed is not None:
        assert out.stdout.strip() == installed


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, tie_word_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_tiny_llama_converts_trains_and_keeps_its_tie():
    plain = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied head is kept in high precision, with a warning
        model = convert_to_fp8(copy.deepcopy(plain))
    fp8 = [name for name, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert not isinstance(model.lm_head, FP8Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert sqnr(model(ids).logits, plain(ids).logits) > FORWARD_SQNR_DB
    opt = FP8AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert model.lm_head.weight is model.model.embed_tokens.weight
