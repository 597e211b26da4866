"""Which Lightning strategies the FP8 precision trains under (strategy_support.py), pinned where a mutation audit found
it unpinned. The references are Lightning's own: its StrategyRegistry (every name it ships, judged by the class it
builds), its case-insensitive strategy names (the connector lowercases them), and its base classes (a subclass of
FSDPStrategy or DDPStrategy is refused as the base is; a subclass of FP8FSDPStrategy is ours as the base is)."""

import pytest
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

import lightning_fp8  # noqa: F401 (registers the strings)
from lightning_fp8.integrations.lightning.precision import precision_class
from lightning_fp8.integrations.lightning.strategy import strategy_class
from lightning_fp8.integrations.lightning.strategy_support import check_supported_strategy
from tests.integrations.lightning.test_registry_routes import NAMESPACES, TRAINER, _package, _strategies


def _refused_families(namespace):
    """The documented refusals (the module's docstring): Lightning's FSDP, DeepSpeed and XLA strategies, by the word
    their message names them with."""
    s = _strategies(namespace)
    return {"FSDP": (s.FSDPStrategy,), "DeepSpeed": (s.DeepSpeedStrategy,), "XLA": (s.XLAStrategy,
            s.SingleDeviceXLAStrategy)}  # fmt: skip


def _reason(error: pytest.ExceptionInfo) -> str:
    """The message after what was passed (``... does not support strategy=X: <reason>``)."""
    return str(error.value).split(": ", 1)[1]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_name_lightning_registers_is_judged_by_the_class_it_builds_in_any_case(namespace):
    """Each of Lightning's own names (xla, single_xla, deepspeed_stage_3, fsdp_cpu_offload, ddp_spawn, ...) is refused
    exactly when its class is one of the refused families, the message naming that family; written in capitals it is
    the same name to Lightning, and gets the same answer."""
    families = _refused_families(namespace)
    fp8_cls = strategy_class(namespace)
    for name, entry in dict(_strategies(namespace).StrategyRegistry).items():
        cls = entry["strategy"]
        family = next((f for f, types in families.items() if issubclass(cls, types)), None)
        if issubclass(cls, fp8_cls) or family is None:
            check_supported_strategy(name, namespace)
            check_supported_strategy(name.upper(), namespace)
            continue
        with pytest.raises(ValueError, match=rf"strategy='{name}': .*{family}") as lower:
            check_supported_strategy(name, namespace)
        with pytest.raises(ValueError) as upper:
            check_supported_strategy(name.upper(), namespace)
        assert _reason(upper) == _reason(lower), name


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_capitalized_names_reach_the_trainer_as_lightning_reads_them(namespace, registered):
    """Lightning lowercases a strategy name: "FSDP" is refused as "fsdp" is (else Lightning's own FSDPStrategy failed
    with another error), a capitalized alias of the FP8 strategy gets the FP8 precision as the alias does, and a
    capitalized name registered with a ddp_comm_hook is refused as the name is."""
    trainer_cls = _package(namespace).Trainer
    with pytest.raises(ValueError) as lower:
        trainer_cls(strategy="fsdp", precision="fp8-lm", devices=2, **TRAINER)
    with pytest.raises(ValueError) as upper:
        trainer_cls(strategy="FSDP", precision="fp8-lm", devices=2, **TRAINER)
    assert _reason(upper) == _reason(lower)

    registered(namespace, "fsdp_fp8_offload", strategy_class(namespace), cpu_offload=True)
    for name in ("fsdp_fp8_offload", "FSDP_FP8_OFFLOAD"):
        trainer = trainer_cls(strategy=name, devices=2, **TRAINER)
        assert type(trainer.strategy) is strategy_class(namespace) and trainer.strategy.cpu_offload.offload_params
        assert type(trainer.precision_plugin) is precision_class(namespace), name

    registered(namespace, "ddp_fp16_hook", _strategies(namespace).DDPStrategy, ddp_comm_hook=fp16_compress_hook)
    for name in ("ddp_fp16_hook", "DDP_FP16_HOOK"):
        with pytest.raises(ValueError, match=r"DDP takes one: .*ddp_comm_hook=fp16_compress_hook"):
            trainer_cls(strategy=name, precision="fp8-lm", devices=1, **TRAINER)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_subclasses_are_judged_as_their_lightning_base_class(namespace, registered):
    """A user's subclass of FSDPStrategy (an instance, or a name registered for it) is refused as FSDPStrategy is; a
    subclass of DDPStrategy with a ddp_comm_hook as DDPStrategy is; a name registered for a subclass of the FP8
    strategy is ours, as an instance of that subclass is."""
    strategies = _strategies(namespace)
    trainer_cls = _package(namespace).Trainer

    class MyFSDP(strategies.FSDPStrategy):
        pass

    class MyDDP(strategies.DDPStrategy):
        pass

    class MyFP8(strategy_class(namespace)):
        pass

    with pytest.raises(ValueError) as base:
        trainer_cls(strategy=strategies.FSDPStrategy(), precision="fp8-lm", devices=2, **TRAINER)
    with pytest.raises(ValueError) as sub:
        trainer_cls(strategy=MyFSDP(), precision="fp8-lm", devices=2, **TRAINER)
    assert _reason(sub) == _reason(base)
    registered(namespace, "my_fsdp", MyFSDP)
    with pytest.raises(ValueError) as sub_by_name:
        trainer_cls(strategy="my_fsdp", precision="fp8-lm", devices=2, **TRAINER)
    assert _reason(sub_by_name) == _reason(base)

    with pytest.raises(ValueError) as base:
        trainer_cls(strategy=strategies.DDPStrategy(ddp_comm_hook=fp16_compress_hook), precision="fp8-lm", **TRAINER)
    with pytest.raises(ValueError) as sub:
        trainer_cls(strategy=MyDDP(ddp_comm_hook=fp16_compress_hook), precision="fp8-lm", **TRAINER)
    assert str(sub.value) == str(base.value)

    registered(namespace, "my_fp8", MyFP8)
    for strategy in (MyFP8(), "my_fp8", strategy_class(namespace)()):
        trainer = trainer_cls(strategy=strategy, devices=2, **TRAINER)
        assert isinstance(trainer.strategy, strategy_class(namespace))
        assert type(trainer.precision_plugin) is precision_class(namespace), strategy


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_name_registered_for_a_factory_function_builds_as_lightning_builds_it(namespace, registered):
    """Lightning's StrategyRegistry takes any callable that returns a strategy; the FP8 precision judges the name by
    its entry and must not take the callable for a class."""
    ddp = _strategies(namespace).DDPStrategy
    registered(namespace, "ddp_by_factory", lambda **kwargs: ddp(**kwargs))
    reference = _package(namespace).Trainer(strategy="ddp_by_factory", devices=1, **TRAINER)
    trainer = _package(namespace).Trainer(strategy="ddp_by_factory", precision="fp8-lm", devices=1, **TRAINER)
    assert type(trainer.strategy) is type(reference.strategy) is ddp
    assert type(trainer.precision_plugin) is precision_class(namespace)
