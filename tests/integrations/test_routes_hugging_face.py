"""Routes a Hugging Face user takes with a converted ``transformers`` model (tiny models built from configs: no
download), each checked against an independent reference: the unconverted model with the same weights (fp32),
``torch.optim.AdamW`` on the same batches, or the model's own earlier run.

Families (Llama, Mistral, Qwen2, GPT-NeoX, OPT, Phi, BERT, T5, GPT-2...), ties, ``save_pretrained`` /
``from_pretrained`` mid-training with the FP8 scaling state beside, ``generate()``, activation checkpointing,
``resize_token_embeddings``, dtype casts. ``tests/integrations/test_hugging_face.py`` covers the import of
transformers from the checkout, Mixtral's experts, Mamba and LongT5; ``tests/test_examples.py`` the ``Trainer``
resume of ``examples/hf_trainer.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from tests.numerics import BACKWARD_SQNR_DB, assert_same, same, sqnr

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Logits of a converted model against the unconverted one with the same weights: two layers of FP8 GEMMs in series
# (each ~25-28 dB, FORWARD_SQNR_DB) and the softmax-free head; measured 23.8 (Phi) to 30 dB (BERT) on these configs.
LOGITS_SQNR_DB = 20.0
# The loss of a few FP8AdamW steps against torch.optim.AdamW on the unconverted model, same batches: FP8 rounding of
# the GEMMs and gradients moves each step a little (measured below 0.3% relative over 4 steps at lr 3e-3).
LOSS_RTOL = 0.02
# generate(): a token the FP8 model chose must be the unconverted model's best on the same prefix, or within this
# fraction of the logits' RMS of it (FP8 logits differ by ~5% of their RMS at LOGITS_SQNR_DB and more: where two
# tokens are closer than that, either is a correct greedy choice).
GREEDY_SLACK = 0.5

VOCAB = 128


def _llama(tie: bool = False, **kw):
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=0, **kw,
    )  # fmt: skip


def _mistral():
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, head_dim=16, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _qwen2():
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _gpt_neox():
    return transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _opt():
    return transformers.OPTForCausalLM, transformers.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        word_embed_proj_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip


def _phi():
    return transformers.PhiForCausalLM, transformers.PhiConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _bert():
    return transformers.BertForMaskedLM, transformers.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip


def _t5():
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=VOCAB, decoder_start_token_id=0,
        pad_token_id=0, dropout_rate=0.0,
    )  # fmt: skip


def _gemma():
    return transformers.GemmaForCausalLM, transformers.GemmaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _qwen3():
    return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def _gptj():
    return transformers.GPTJForCausalLM, transformers.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    )  # fmt: skip


# family -> (builder, the linear layers convert_to_fp8 leaves as nn.Linear: tied heads, T5's float32 wo)
FAMILIES: dict[str, tuple[Callable, set[str]]] = {
    "llama": (_llama, set()),
    "llama-tied": (lambda: _llama(tie=True), {"lm_head"}),
    "mistral": (_mistral, set()),
    "qwen2": (_qwen2, set()),
    "gpt-neox": (_gpt_neox, set()),
    "opt": (_opt, {"lm_head"}),
    "phi": (_phi, set()),
    "bert": (_bert, {"cls.predictions.decoder"}),
    "t5": (_t5, {"lm_head", "encoder.block.0.layer.1.DenseReluDense.wo", "decoder.block.0.layer.2.DenseReluDense.wo"}),
    "gemma": (_gemma, {"lm_head"}),
    "qwen3": (_qwen3, set()),
    "gptj": (_gptj, set()),
}
ENCODER_DECODER = {"t5"}
MASKED_LM = {"bert"}


def _build(family: str, seed: int = 0) -> nn.Module:
    cls, config = FAMILIES[family][0]()
    torch.manual_seed(seed)
    return cls(config)


def _convert(model: nn.Module, **kwargs) -> nn.Module:
    """convert_to_fp8 without its warnings (which layers stay in high precision is asserted where it matters)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_fp8(model, **kwargs)


def _batch(family: str, seed: int = 1, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Fresh random tokens with padding at the end of the last row (attention_mask 0 there), and labels (-100 at the
    padding; for a masked LM, at every other position too)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, seq - 5 :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if family in ENCODER_DECODER:
        labels = torch.randint(1, VOCAB, (batch, seq // 2), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    labels = ids.masked_fill(mask == 0, -100)
    if family in MASKED_LM:
        labels[:, ::2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if "labels" in batch and batch["labels"].shape != batch["input_ids"].shape:  # encoder-decoder: teacher forcing
        inputs["decoder_input_ids"] = batch["labels"]
    with torch.no_grad():
        return model(**inputs).logits


def _fp8_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict]) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _left_as_linear(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m) is nn.Linear}


# ---------------------------------------------------------------------------------------------------------------------
# Families: what converts, the forward against the unconverted model, training against torch.optim.AdamW
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_converts_as_documented_and_its_logits_match_the_unconverted_model(family):
    plain = _build(family).eval()
    model = _convert(copy.deepcopy(plain))
    assert _left_as_linear(model) == FAMILIES[family][1]
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    assert model.state_dict().keys() == plain.state_dict().keys()  # checkpoints load before or after conversion
    batch = _batch(family)
    assert sqnr(_logits(model, batch), _logits(plain, batch)) > LOGITS_SQNR_DB
    # the output head left out with module_filter_fn, as the docs advise
    kept = _convert(copy.deepcopy(plain), module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    head = plain.get_output_embeddings()
    head_name = next(name for name, m in plain.named_modules() if m is head)
    assert type(kept.get_submodule(head_name)) is nn.Linear
    assert sqnr(_logits(kept, batch), _logits(plain, batch)) > LOGITS_SQNR_DB


@pytest.mark.parametrize("recipe", ["fp8-lm-o1", "fp8-lm"])
@pytest.mark.parametrize("family", ["llama", "gpt-neox", "opt", "phi", "bert", "t5"])
def test_fp8adamw_training_follows_torch_adamw_on_the_unconverted_model(family, recipe):
    """labels= loss path, attention_mask with padding, 4 steps on one batch."""
    plain = _build(family)
    model = _convert(copy.deepcopy(plain), recipe=recipe)
    batches = [_batch(family)] * 4
    losses = _fp8_losses(model, FP8AdamW(model.parameters(), lr=3e-3, recipe=recipe), batches)
    reference = _fp8_losses(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3), batches)
    assert losses[-1] < losses[0] - 0.1, losses
    assert losses == pytest.approx(reference, rel=LOSS_RTOL), (losses, reference)
    # the trained weights (state_dict: true values at O2 too) give the trained FP8 model's logits in a plain model
    check = _build(family, seed=7)
    check.load_state_dict(model.state_dict())
    assert sqnr(_logits(model, batches[0]), _logits(check, batches[0])) > LOGITS_SQNR_DB


def test_padding_does_not_change_the_unpadded_rows_beyond_fp8_error():
    """A padded row's masked positions enter the FP8 layers' amaxes (the scales), not the other rows' outputs."""
    plain = _build("llama").eval()
    model = _convert(copy.deepcopy(plain)).eval()
    batch = _batch("llama")
    mask = batch["attention_mask"].bool()
    fp8, ref = _logits(model, batch), _logits(plain, batch)
    assert sqnr(fp8[mask], ref[mask]) > LOGITS_SQNR_DB
    assert torch.isfinite(fp8).all()


def test_gpt2_conv1d_projections_stay_high_precision_named_in_a_warning(fresh_warnings):
    """GPT-2's projections are transformers' Conv1D, not nn.Linear (docs/concepts/gemms.md): nothing converts, the
    warning names them, the forward is the unconverted model's bit for bit, and the filter is asked about them."""
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match="transformers' Conv1D") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "Conv1D" in str(w.message))
    assert "transformer.h.0.attn.c_attn (64->192)" in message and "transformer.h.1.mlp.c_proj (256->64)" in message
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    batch = _batch("gpt2")
    assert_same(_logits(model, batch), _logits(plain, batch))
    # asked as a linear layer: a filter that says no keeps the warning away
    lightning_fp8.warnings._seen.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        convert_to_fp8(copy.deepcopy(plain), module_filter_fn=lambda m, fqn: type(m).__name__ != "Conv1D")
    assert not [w for w in record if "Conv1D" in str(w.message)]
    # a filter written for nn.Linear (torchao's style) fails on a Conv1D: an error that names it, nothing changed
    model = copy.deepcopy(plain)
    with pytest.raises(AttributeError, match=r"for 'transformer\.h\.0\.attn\.c_attn', a Conv1D: .*getattr\(module, "
                                             r"'in_features', 0\)\. Nothing was changed"):  # fmt: skip
        convert_to_fp8(model, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0)
    assert_same(_logits(model, batch), _logits(plain, batch))
    assert [type(m) for m in model.modules()] == [type(m) for m in plain.modules()]
    mixed = nn.Sequential(nn.Linear(64, 64), type(plain.transformer.h[0].attn.c_attn)(64, 64))
    with pytest.raises(AttributeError, match="a Conv1D"):  # the nn.Linear answered first is not converted either
        convert_to_fp8(mixed, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0)
    assert type(mixed[0]) is nn.Linear


# ---------------------------------------------------------------------------------------------------------------------
# Ties
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["fp8-lm-o1", "fp8-lm"])
def test_a_tied_head_stays_tied_through_training_and_tie_weights(recipe):
    model = _convert(_build("llama-tied"), recipe=recipe)
    embedding = model.get_input_embeddings()
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is embedding.weight
    optimizer = FP8AdamW(model.parameters(), lr=3e-3, recipe=recipe)
    _fp8_losses(model, optimizer, [_batch("llama-tied")] * 2)
    model.tie_weights()  # as from_pretrained and post_init call it
    assert model.lm_head.weight is embedding.weight and model.get_output_embeddings() is model.lm_head
    _fp8_losses(model, optimizer, [_batch("llama-tied")])
    assert model.lm_head.weight is embedding.weight
    state = model.state_dict()
    assert_same(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_an_untied_fp8_head_is_left_alone_by_tie_weights():
    model = _convert(_build("llama"))
    head = model.lm_head
    model.tie_weights()
    assert model.lm_head is head and isinstance(head, FP8Linear)
    assert model.lm_head.weight is not model.get_input_embeddings().weight


def test_a_tie_made_by_tie_weights_after_conversion_trains_the_shared_weight_in_high_precision():
    """transformers ties by ``setattr(lm_head, "weight", embed_tokens.weight)``: a plain Parameter registered on the
    FP8 head, which FP8AdamW (built after) trains in high precision (docs/concepts/gemms.md): the embedding reads
    the true weight at O2, and the head still runs FP8 GEMMs."""
    model = _convert(_build("llama"))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings()
    assert isinstance(model.lm_head, FP8Linear) and model.lm_head.weight is embedding.weight
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    losses = _fp8_losses(model, optimizer, [_batch("llama")] * 3)
    assert losses[-1] < losses[0], losses
    assert embedding.weight.dtype == torch.float32
    assert_same(model.state_dict()["model.embed_tokens.weight"], embedding.weight.detach())
    check = _build("llama-tied", seed=7)
    check.load_state_dict(model.state_dict())
    batch = _batch("llama")
    assert sqnr(_logits(model, batch), _logits(check, batch)) > LOGITS_SQNR_DB


# ---------------------------------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained mid-training, and the FP8 scaling state beside
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["fp8-lm-o1", "fp8-lm"])
def test_save_pretrained_mid_training_holds_the_true_weights_and_resumes_bit_for_bit(tmp_path, recipe):
    batches = [_batch("llama", seed=s) for s in range(5)]
    model = _convert(_build("llama"), recipe=recipe)
    optimizer = FP8AdamW(model.parameters(), lr=3e-3, recipe=recipe)
    _fp8_losses(model, optimizer, batches[:2])
    model.save_pretrained(tmp_path)
    torch.save({"fp8": fp8_state_dict(model), "optimizer": optimizer.state_dict()}, tmp_path / "fp8_training.pt")
    if recipe == "fp8-lm":  # the storage is FP8AdamW's scaled fp16 master; the file holds the weight
        assert model.lm_head.weight.dtype == torch.float16
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert_same(saved, {k: v for k, v in model.state_dict().items() if k in saved})
    assert saved["lm_head.weight"].dtype == torch.float32
    # the unconverted model from the folder computes what the FP8 model does, within FP8 error
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert_same(plain.state_dict(), model.state_dict())
    # on a copy: an evaluation forward records its amaxes into the histories (docs/guides/lightning.md)
    assert sqnr(_logits(copy.deepcopy(model), batches[0]), _logits(plain, batches[0])) > LOGITS_SQNR_DB
    uninterrupted = _fp8_losses(model, optimizer, batches[2:])
    # resume as examples/hf_trainer.py's FP8StateCallback does: weights, then the FP8 state and the optimizer's
    resumed = _convert(transformers.LlamaForCausalLM.from_pretrained(tmp_path), recipe=recipe)
    checkpoint = torch.load(tmp_path / "fp8_training.pt", weights_only=True)
    load_fp8_state_dict(resumed, checkpoint["fp8"])
    resumed_optimizer = FP8AdamW(resumed.parameters(), lr=3e-3, recipe=recipe)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    assert _fp8_losses(resumed, resumed_optimizer, batches[2:]) == uninterrupted
    assert_same(resumed.state_dict(), model.state_dict())
    assert_same(fp8_state_dict(resumed), fp8_state_dict(model))


def test_without_the_fp8_state_a_resume_starts_fresh_scales_and_differs(tmp_path):
    """The reason for fp8_state_dict beside save_pretrained: the scaling state is in non-persistent buffers."""
    batches = [_batch("llama", seed=s) for s in range(4)]
    model = _convert(_build("llama"), recipe="fp8-lm-o1")
    optimizer = FP8AdamW(model.parameters(), lr=3e-3, recipe="fp8-lm-o1")
    _fp8_losses(model, optimizer, batches[:2])
    model.save_pretrained(tmp_path)
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    assert not [k for k in safetensors_torch.load_file(tmp_path / "model.safetensors") if "fp8" in k]
    uninterrupted = _fp8_losses(model, optimizer, batches[2:])
    resumed = _convert(transformers.LlamaForCausalLM.from_pretrained(tmp_path), recipe="fp8-lm-o1")
    resumed_optimizer = FP8AdamW(resumed.parameters(), lr=3e-3, recipe="fp8-lm-o1")
    resumed_optimizer.load_state_dict(saved_optimizer)
    fresh = _fp8_losses(resumed, resumed_optimizer, batches[2:])
    assert fresh != uninterrupted and fresh == pytest.approx(uninterrupted, rel=1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# generate()
# ---------------------------------------------------------------------------------------------------------------------


def _check_greedy(plain: nn.Module, sequences: torch.Tensor, prompt_len: int, mask: torch.Tensor) -> None:
    """Each token the FP8 model chose is the unconverted model's greedy choice on the same prefix, up to
    GREEDY_SLACK (teacher forcing the FP8 model's sequence through the unconverted one), until the row's EOS (generate
    pads a finished row)."""
    new = sequences[:, prompt_len:]
    eos = plain.generation_config.eos_token_id
    finished = (new == eos).int().cumsum(1) - (new == eos).int()  # after the first EOS
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():
        logits = plain(input_ids=sequences, attention_mask=full_mask).logits[:, prompt_len - 1 : -1]
    chosen = logits.gather(-1, new[..., None]).squeeze(-1)
    slack = GREEDY_SLACK * logits.pow(2).mean().sqrt()
    ok = (chosen >= logits.amax(-1) - slack) | (finished > 0)
    assert ok.all(), (chosen, logits.amax(-1), slack)


def test_generate_greedy_with_and_without_cache_picks_the_unconverted_models_tokens():
    plain = _build("llama").eval()
    model = _convert(copy.deepcopy(plain)).eval()
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0  # left padding, as for generation
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
        reference = plain.generate(ids, **kwargs)
    assert cached.shape == uncached.shape == reference.shape == (2, 13)
    for sequences in (cached, uncached):
        _check_greedy(plain, sequences, 8, mask)
    # the first new token of each row comes from the same prefill forward (the cache changes only the later steps)
    assert torch.equal(cached[:, 8], uncached[:, 8])


def test_generate_runs_on_an_encoder_decoder_trained_at_o2_and_training_goes_on():
    plain = _build("t5")
    model = _convert(copy.deepcopy(plain))
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    batch = _batch("t5")
    _fp8_losses(model, optimizer, [batch] * 2)
    model.eval()
    with torch.inference_mode():  # a user's choice over generate's own no_grad: the scaling buffers stay usable
        out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4)
    assert out.shape == (2, 5) and (out < VOCAB).all()
    check = _build("t5", seed=7).eval()
    check.load_state_dict(model.state_dict())
    with torch.no_grad():
        same_weights = check.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=1)
    assert_same(out[:, :2], same_weights)  # T5's first step: one decoder token, a clear margin here
    model.train()
    losses = _fp8_losses(model, optimizer, [batch] * 2)
    assert all(torch.isfinite(torch.tensor(losses))), losses


# ---------------------------------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------------------------------


def _enable_checkpointing(model: nn.Module, use_reentrant: bool) -> None:
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x: gradient_checkpointing_enable's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def test_activation_checkpointing_non_reentrant_gives_the_gradients_bit_for_bit():
    model = _convert(_build("llama"), recipe="fp8-lm-o1")
    checkpointed = copy.deepcopy(model)
    _enable_checkpointing(checkpointed, use_reentrant=False)
    optimizers = [FP8AdamW(m.parameters(), lr=3e-3, recipe="fp8-lm-o1", fp8_grads=False) for m in (model, checkpointed)]
    for seed in range(2):
        batch = _batch("llama", seed=seed)
        for m in (model, checkpointed):
            m(**batch).loss.backward()
        assert_same(
            {n: p.grad for n, p in checkpointed.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
        )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_same(fp8_state_dict(checkpointed), fp8_state_dict(model))


def test_activation_checkpointing_non_reentrant_trains_bit_for_bit_at_o2():
    model = _convert(_build("llama"))
    checkpointed = copy.deepcopy(model)
    _enable_checkpointing(checkpointed, use_reentrant=False)
    batches = [_batch("llama", seed=s) for s in range(3)]
    losses = _fp8_losses(model, FP8AdamW(model.parameters(), lr=3e-3), batches)
    assert _fp8_losses(checkpointed, FP8AdamW(checkpointed.parameters(), lr=3e-3), batches) == losses
    assert_same(checkpointed.state_dict(), model.state_dict())


def test_activation_checkpointing_reentrant_warns_and_stays_fp8_accurate(fresh_warnings):
    """use_reentrant=True runs the forward under no_grad: the recompute casts with its own amax (docs), once warned."""
    model = _convert(_build("llama"), recipe="fp8-lm-o1")
    checkpointed = copy.deepcopy(model)
    _enable_checkpointing(checkpointed, use_reentrant=True)
    optimizers = [FP8AdamW(m.parameters(), lr=3e-3, recipe="fp8-lm-o1", fp8_grads=False) for m in (model, checkpointed)]
    with pytest.warns(UserWarning, match="use_reentrant=True"):
        for seed in range(2):
            batch = _batch("llama", seed=seed)
            for m in (model, checkpointed):
                m(**batch).loss.backward()
            for (name, p), q in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
                assert sqnr(q.grad, p.grad) > BACKWARD_SQNR_DB, name
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()


# ---------------------------------------------------------------------------------------------------------------------
# resize_token_embeddings, dtype casts, the model API
# ---------------------------------------------------------------------------------------------------------------------


def test_resize_token_embeddings_of_an_untied_fp8_head_as_documented():
    """transformers builds a new nn.Linear head: convert again (docs/guides/pytorch.md). At O2, after
    release_weights() the copied rows are the true weights (not FP8AdamW's scaled fp16 storage)."""
    model = _convert(_build("llama"))
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    _fp8_losses(model, optimizer, [_batch("llama")] * 2)
    before = model.state_dict()
    optimizer.release_weights()
    model.resize_token_embeddings(VOCAB + 16, mean_resizing=False)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.shape == (VOCAB + 16, 64)
    assert_same(model.lm_head.weight[:VOCAB].detach(), before["lm_head.weight"])
    assert_same(model.get_input_embeddings().weight[:VOCAB].detach(), before["model.embed_tokens.weight"])
    _convert(model)
    assert isinstance(model.lm_head, FP8Linear)
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    batch = _batch("llama")
    batch["input_ids"][0, 0] = VOCAB + 3  # a new token
    losses = _fp8_losses(model, optimizer, [batch] * 3)
    assert losses[-1] < losses[0], losses


def test_resize_token_embeddings_of_a_tied_model_keeps_the_tie():
    model = _convert(_build("llama-tied"))
    model.resize_token_embeddings(VOCAB + 16)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.shape == (VOCAB + 16, 64)
    losses = _fp8_losses(model, FP8AdamW(model.parameters(), lr=3e-3), [_batch("llama-tied")] * 3)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ["fp8-lm-o1", "fp8-lm"])
def test_a_cast_after_conversion_before_the_optimizer_trains(dtype, recipe):
    model = _convert(_build("llama"), recipe=recipe)
    model = model.bfloat16() if dtype == torch.bfloat16 else model.half()
    assert model.dtype == dtype
    assert {v.dtype for v in fp8_state_dict(model).values() if v.is_floating_point()} == {torch.float32}
    reference = _convert(_build("llama"), recipe=recipe)
    batches = [_batch("llama")] * 3
    losses = _fp8_losses(model, FP8AdamW(model.parameters(), lr=3e-3, recipe=recipe), batches)
    expected = _fp8_losses(reference, FP8AdamW(reference.parameters(), lr=3e-3, recipe=recipe), batches)
    assert losses == pytest.approx(expected, rel=LOSS_RTOL)
    assert {v.dtype for v in model.state_dict().values()} == {dtype}


def test_after_fp8adamw_at_o2_half_is_accepted_and_bfloat16_refused():
    """docs/guides/checkpoints.md: a cast that changes the O2 FP8 weights' dtype is refused at the next step, with
    nothing stepped; half() keeps them as they are."""
    batch = _batch("llama")
    model = _convert(_build("llama"))
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    _fp8_losses(model, optimizer, [batch])
    model.bfloat16()
    before = copy.deepcopy(model.state_dict())
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="FP8AdamW keeps its torch.float16 master there"):
        optimizer.step()
    assert_same(model.state_dict(), before)

    model = _convert(_build("llama"))
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    losses = _fp8_losses(model, optimizer, [batch])
    model.half()
    losses += _fp8_losses(model, optimizer, [batch] * 2)
    assert losses[-1] < losses[0], losses
    state = model.state_dict()
    assert state["lm_head.weight"].dtype == torch.float32 and state["model.norm.weight"].dtype == torch.float16


def test_a_bfloat16_model_from_its_config_trains_at_o2_and_resumes_bit_for_bit():
    """dtype=bfloat16 at build time (as from_pretrained(dtype=...) gives). The resume goes through load_state_dict:
    from_pretrained gives the rotary inv_freq buffer in float32 where model.to(bfloat16) made it bfloat16, a
    difference of transformers (the unconverted model shows it too)."""
    cls, config = _llama()
    torch.manual_seed(0)
    model = _convert(cls._from_config(config, dtype=torch.bfloat16))
    assert model.dtype == torch.bfloat16 and isinstance(model.lm_head, FP8Linear)
    batches = [_batch("llama", seed=s) for s in range(4)]
    optimizer = FP8AdamW(model.parameters(), lr=3e-3)
    _fp8_losses(model, optimizer, batches[:2])
    saved = copy.deepcopy({"model": model.state_dict(), "fp8": fp8_state_dict(model), "opt": optimizer.state_dict()})
    assert {v.dtype for v in saved["model"].values()} == {torch.bfloat16}
    uninterrupted = _fp8_losses(model, optimizer, batches[2:])
    resumed = _convert(cls._from_config(config, dtype=torch.bfloat16))
    resumed.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed, saved["fp8"])
    resumed_optimizer = FP8AdamW(resumed.parameters(), lr=3e-3)
    resumed_optimizer.load_state_dict(saved["opt"])
    assert _fp8_losses(resumed, resumed_optimizer, batches[2:]) == uninterrupted


def test_the_model_api_sees_the_converted_model_as_the_unconverted_one():
    plain = _build("llama")
    model = _convert(copy.deepcopy(plain))
    assert model.num_parameters() == plain.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == plain.num_parameters(exclude_embeddings=True)
    assert model.get_input_embeddings() is model.model.embed_tokens
    assert model.get_output_embeddings() is model.lm_head and isinstance(model.lm_head, FP8Linear)
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    # eval and train toggles change nothing in what a step computes (no dropout here)
    batch = _batch("llama")
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    b.eval()
    b.train()
    assert _fp8_losses(a, FP8AdamW(a.parameters(), lr=3e-3), [batch] * 2) == _fp8_losses(
        b, FP8AdamW(b.parameters(), lr=3e-3), [batch] * 2
    )
    assert same(fp8_state_dict(a), fp8_state_dict(b))
