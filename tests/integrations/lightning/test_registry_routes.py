"""The same FP8 intent reaches the Trainer the same way by every route Lightning offers: a name registered for the
FP8 strategy's class works as "fsdp_fp8" does, and an FP8 plugin or strategy object of the other Lightning package
(lightning vs pytorch_lightning) is refused naming the class to build, where Lightning called it an invalid type."""

import importlib

import pytest

import lightning_fp8  # noqa: F401 (registers the strings)
from lightning_fp8 import FP8Recipe
from lightning_fp8.integrations.lightning import registry
from lightning_fp8.integrations.lightning.precision import precision_class
from lightning_fp8.integrations.lightning.strategy import strategy_class

NAMESPACES = [ns for ns in registry.NAMESPACES if importlib.util.find_spec(ns) is not None]
TRAINER = {"enable_progress_bar": False, "logger": False, "enable_checkpointing": False, "accelerator": "cpu"}


def _package(namespace):
    return importlib.import_module("pytorch_lightning" if namespace == "pytorch_lightning" else "lightning")


def _strategies(namespace):
    root = "pytorch_lightning" if namespace == "pytorch_lightning" else "lightning.pytorch"
    return importlib.import_module(f"{root}.strategies")


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("name", ["fsdp_fp8_offload", "sharded_fp8"])
@pytest.mark.parametrize("precision", ["fp8-lm-o1", None])
def test_a_name_registered_for_the_fp8_strategy_works_as_fsdp_fp8(namespace, name, precision, registered):
    registered(namespace, name, strategy_class(namespace), cpu_offload=True)
    trainer = _package(namespace).Trainer(strategy=name, devices=2, precision=precision, **TRAINER)
    reference = _package(namespace).Trainer(strategy="fsdp_fp8", devices=2, precision=precision, **TRAINER)
    assert type(trainer.strategy) is type(reference.strategy) is strategy_class(namespace)
    assert trainer.strategy.cpu_offload.offload_params and not reference.strategy.cpu_offload.offload_params
    assert type(trainer.precision_plugin) is type(reference.precision_plugin) is precision_class(namespace)
    assert trainer.precision_plugin.recipe == reference.precision_plugin.recipe


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_name_registered_for_lightnings_fsdp_is_refused_by_its_class_not_its_name(namespace, registered):
    registered(namespace, "sharded_plain", _strategies(namespace).FSDPStrategy)
    with pytest.raises(ValueError, match=r"does not support strategy='sharded_plain': Lightning's FSDPStrategy"):
        _package(namespace).Trainer(strategy="sharded_plain", devices=2, precision="fp8-lm", **TRAINER)
    registered(namespace, "ddp_fsdp_like_name", _strategies(namespace).DDPStrategy)
    trainer = _package(namespace).Trainer(strategy="ddp_fsdp_like_name", devices=2, precision="fp8-lm", **TRAINER)
    assert type(trainer.precision_plugin) is precision_class(namespace)


@pytest.mark.skipif(len(NAMESPACES) < 2, reason="needs both lightning and pytorch_lightning installed")
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_an_fp8_object_of_the_other_package_is_refused_naming_the_class_to_build(namespace):
    other = next(ns for ns in NAMESPACES if ns != namespace)
    trainer_cls = _package(namespace).Trainer
    expected = precision_class(namespace).__name__
    with pytest.raises(TypeError, match=rf"Trainer\(plugins=\.\.\.\).*Build {expected}\(\.\.\.\) instead"):
        trainer_cls(plugins=[precision_class(other)(recipe=FP8Recipe(margin=1))], **TRAINER)
    expected = strategy_class(namespace).__name__
    with pytest.raises(TypeError, match=rf"Trainer\(strategy=\.\.\.\).*Build {expected}\(\.\.\.\) instead"):
        trainer_cls(strategy=strategy_class(other)(), devices=2, **TRAINER)
    # What the message says to build works, with the same arguments.
    trainer = trainer_cls(plugins=[precision_class(namespace)(recipe=FP8Recipe(margin=1))], **TRAINER)
    assert trainer.precision_plugin.recipe.margin == 1


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_name_registered_with_a_ddp_comm_hook_is_refused_as_the_strategy_object_is(namespace, registered):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    ddp = _strategies(namespace).DDPStrategy
    registered(namespace, "ddp_fp16_hook", ddp, ddp_comm_hook=fp16_compress_hook)
    trainer_cls = _package(namespace).Trainer
    for strategy in (ddp(ddp_comm_hook=fp16_compress_hook), "ddp_fp16_hook"):
        with pytest.raises(ValueError, match=r"DDP takes one: .*ddp_comm_hook=fp16_compress_hook.*fp8_communication"):
            trainer_cls(strategy=strategy, precision="fp8-lm", devices=1, **TRAINER)
    # Without the FP8 all-reduce the user's hook is theirs to keep, by either route.
    for strategy in (ddp(ddp_comm_hook=fp16_compress_hook), "ddp_fp16_hook"):
        plugin = precision_class(namespace)(fp8_communication=False)
        assert trainer_cls(strategy=strategy, plugins=[plugin], devices=1, **TRAINER).strategy._ddp_comm_hook
    registered(namespace, "ddp_no_hook", ddp)
    assert trainer_cls(strategy="ddp_no_hook", precision="fp8-lm", devices=1, **TRAINER).precision_plugin
