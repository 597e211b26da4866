"""Hugging Face transformers models (tiny, built from configs: no download) converted and trained: run with the
README's test command from the checkout's root, where the repository's ``kernels/`` folder shadowed the ``kernels``
distribution transformers imports (every model import failed: "cannot import name 'CUDAProperties' from 'kernels'");
which layers become FP8 and which stay in high precision, named in a warning (Mamba, LongT5, Mixtral)."""

import copy
import importlib.machinery
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8
from tests.numerics import FORWARD_SQNR_DB, sqnr

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
# Logits of a converted model against the unconverted one with the same weights: several FP8 GEMMs in series
# (measured ~28 dB for the two-layer Mamba below).
MODEL_SQNR_DB = 20.0


def _train(model: nn.Module, steps: int, lr: float = 1e-3, **batch: torch.Tensor) -> list[float]:
    """The losses of ``steps`` FP8AdamW steps of ``model`` on one batch (its ``labels`` included)."""
    optimizer = FP8AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


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
    losses = _train(model, 6, lr=3e-3, input_ids=ids, labels=ids)
    assert losses[-1] < losses[0] - 0.1, losses
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_mixture_of_experts_weights_are_named_in_a_warning(fresh_warnings):
    """transformers 5 holds each MoE projection of all experts as one 3-D nn.Parameter (MixtralExperts.gate_up_proj,
    down_proj), not nn.Linear: 82% of this Mixtral's parameters stayed in high precision without a word (found by a
    sweep with tiny transformers models; GPT-2's Conv1D is named the same way)."""
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with pytest.warns(UserWarning, match="mixture of experts' expert weights") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "experts' expert weights" in str(w.message))
    assert "model.layers.0.mlp.experts (4 experts), model.layers.1.mlp.experts (4 experts)" in message
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    # the filter is asked about linear layers only: one that reads in_features does not meet the experts module
    lightning_fp8.warnings._seen.clear()
    plain = transformers.MixtralForCausalLM(config)
    with pytest.warns(UserWarning, match="mixture of experts' expert weights"):
        convert_to_fp8(plain, module_filter_fn=lambda module, fqn: module.in_features % 16 == 0)
    assert isinstance(plain.model.layers[0].self_attn.q_proj, FP8Linear)


def _mamba() -> nn.Module:
    config = transformers.MambaConfig(
        hidden_size=64, state_size=16, num_hidden_layers=2, vocab_size=128, expand=2, time_step_rank=16
    )
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config)


def test_layers_whose_weight_the_model_reads_itself_stay_high_precision_and_train_at_o2(fresh_warnings):
    """Mamba's mixer computes ``self.dt_proj.weight @ time_step`` itself (and hands x_proj's and out_proj's weights
    to its fused kernel): converted, at O2 it read FP8AdamW's scaled fp16 master, and the second step failed with
    "expected m1 and m2 to have the same dtype, but got: float != c10::Half" (a half model: wrong values, silently)."""
    model = _mamba()
    with pytest.warns(UserWarning, match="reads their weight itself") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "reads their weight itself" in str(w.message))
    mixer = model.backbone.layers[0].mixer
    assert "backbone.layers.0.mixer.dt_proj" in message and "backbone.layers.1.mixer.out_proj" in message
    assert type(mixer.dt_proj) is nn.Linear and type(mixer.x_proj) is nn.Linear and type(mixer.out_proj) is nn.Linear
    assert isinstance(mixer.in_proj, FP8Linear)  # called as a layer only
    ids = _tokens(2, 8)
    losses = _train(model, 2, input_ids=ids, labels=ids)
    assert losses[-1] < losses[0], losses
    plain = _mamba()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert sqnr(model(ids).logits, plain(ids).logits) > MODEL_SQNR_DB


def test_a_t5_style_feed_forward_without_keep_in_fp32_keeps_its_input_dtype_at_o2(fresh_warnings):
    """LongT5 (as SwitchTransformers, Pix2Struct) casts its feed-forward's input to ``wo.weight.dtype``, as T5 does,
    but declares no ``_keep_in_fp32_modules``: ``wo`` became FP8, and FP8AdamW's O2 master made that cast float16
    (T5's activations overflow there). It stays in high precision now, named in a warning."""
    config = transformers.LongT5Config(
        d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=128, decoder_start_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LongT5ForConditionalGeneration(config)
    with pytest.warns(UserWarning, match="casts their input to their weight's dtype") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "weight's dtype" in str(w.message))
    assert message.endswith("encoder.block.0.layer.1.DenseReluDense.wo, decoder.block.0.layer.2.DenseReluDense.wo")
    wo = model.encoder.block[0].layer[-1].DenseReluDense.wo
    assert type(wo) is nn.Linear and isinstance(model.encoder.block[0].layer[-1].DenseReluDense.wi, FP8Linear)
    seen = []
    wo.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    _train(model, 2, input_ids=_tokens(2, 8), labels=_tokens(2, 4))
    assert seen == [torch.float32, torch.float32]
