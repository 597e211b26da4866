"""The "fp8-lm" / "fsdp_fp8" registration: it works in both namespaces, is idempotent, rejects what FP8 cannot
run under, and fails loudly here if Lightning's internals move."""

import importlib
import inspect
import pickle
import sys
import typing

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

import lightning_fp8
import lightning_fp8.warnings
from lightning_fp8 import FP8Recipe
from lightning_fp8.integrations.lightning import FP8FSDPStrategy, FP8LMPrecision, registry
from lightning_fp8.integrations.lightning.precision import precision_class
from lightning_fp8.integrations.lightning.strategy import strategy_class

NAMESPACES = [ns for ns in registry.NAMESPACES if importlib.util.find_spec(ns) is not None]
TRAINER = {"enable_progress_bar": False, "logger": False, "enable_checkpointing": False, "accelerator": "cpu"}


def _trainer_cls(namespace: str):
    return importlib.import_module("pytorch_lightning" if namespace == "pytorch_lightning" else "lightning").Trainer


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_internals_are_where_the_registry_expects_them(namespace):
    # If this fails, Lightning moved the code registry.py hooks into: update registry.py for the new version.
    module = registry._connector_module(namespace)
    method = inspect.unwrap(module._AcceleratorConnector._check_config_and_set_final_flags)
    assert {"strategy", "precision", "plugins"} <= set(inspect.signature(method).parameters)
    precision_literal = typing.get_args(module._PRECISION_INPUT_STR)
    assert "bf16-mixed" in precision_literal and "fp8-lm" not in precision_literal  # still a closed Literal
    assert hasattr(module._AcceleratorConnector, "_check_and_init_precision")
    assert registry.is_registered(namespace), f"lightning_fp8 did not register with {namespace}"


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("name", FP8Recipe.names())
def test_precision_string_builds_the_plugin(namespace, name):
    trainer = _trainer_cls(namespace)(precision=name, **TRAINER)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, precision_class(namespace)) and plugin.recipe == FP8Recipe.from_name(name)
    assert trainer.precision == "fp8-lm"
    base = importlib.import_module(registry._plugins_module(namespace)).Precision
    assert isinstance(plugin, base)


def test_plugin_instance_works_without_the_string():
    plugin = FP8LMPrecision(recipe=FP8Recipe(scaling="current", margin=1))
    assert L.Trainer(plugins=[plugin], **TRAINER).precision_plugin is plugin


def test_register_is_idempotent_and_leaves_other_precisions_alone():
    connector = registry._connector_module("lightning")._AcceleratorConnector
    before = connector._check_config_and_set_final_flags
    registry.register()
    lightning_fp8._register_with_lightning()
    assert connector._check_config_and_set_final_flags is before
    assert not getattr(before.__wrapped__, registry._MARK, False)  # wrapped exactly once
    assert isinstance(L.Trainer(precision="bf16-mixed", **TRAINER).precision_plugin, MixedPrecision)
    with pytest.raises(ValueError, match="Precision 'fp9' is invalid"):
        L.Trainer(precision="fp9", **TRAINER)
    assert StrategyRegistry["fsdp_fp8"]["strategy"] is FP8FSDPStrategy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp8-lm", "strategy": "fsdp"}, "use strategy='fsdp_fp8'"),
        ({"precision": "fp8-lm", "strategy": "deepspeed"}, "DeepSpeed owns precision"),
        ({"precision": "fp8-lm", "strategy": FSDPStrategy()}, "use strategy='fsdp_fp8'"),
        ({"plugins": [FP8LMPrecision()], "strategy": "fsdp_cpu_offload"}, "use strategy='fsdp_fp8'"),
        ({"precision": "fp8-lm", "plugins": [FP8LMPrecision()]}, "choose one"),
        ({"precision": "bf16-mixed", "strategy": "fsdp_fp8"}, "pass `precision='fp8-lm'`"),
    ],
)
def test_unsupported_combinations_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(**kwargs, **TRAINER)


@pytest.mark.parametrize("precision", ["fp8", "fp8-LM", "fp8_lm"])
def test_close_misses_of_fp8_precision_names_suggest_the_name(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}'\) is not a known precision: did you mean 'fp8-lm'"):
        L.Trainer(precision=precision, accelerator="cpu", logger=False)


@pytest.mark.parametrize(
    ("precision", "meant"),
    [("hybird", "fp8-lm"), ("e4m3", "fp8-lm-e4m3"), ("fp-lm", "fp8-lm"), ("delayed", "fp8-lm"),
     ("fp8-lm-o2", "fp8-lm"), ("current", "fp8-lm-current"), ("fp8-lm-curent", "fp8-lm-current")],
)  # fmt: skip
def test_recipe_words_as_a_precision_name_the_fp8_precisions_and_the_recipe_plugin(precision, meant):
    # Lightning's own error listed only its precisions: one meant as an FP8 recipe was not told of ours.
    with pytest.raises(ValueError, match=rf"did you mean '{meant}'\? The FP8 precisions are \['fp8-lm'.*"
                                         r"FP8LMPrecision\(recipe=FP8Recipe"):  # fmt: skip
        L.Trainer(precision=precision, accelerator="cpu", logger=False)


@pytest.mark.parametrize("precision", ["bf16-mixd", "16-mixd"])
def test_typos_of_lightnings_own_precisions_get_lightnings_error(precision):
    with pytest.raises(ValueError, match="Allowed precision values"):
        L.Trainer(precision=precision, accelerator="cpu", logger=False)


def test_fsdp_fp8_strategy_rejects_sharded_checkpoints_when_built():
    with pytest.raises(ValueError, match=r"full \(single-file\) checkpoints; got state_dict_type='sharded'"):
        FP8FSDPStrategy(state_dict_type="sharded")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sharding_strategy": "HYBRID_SHARD"},
        {"sharding_strategy": "_HYBRID_SHARD_ZERO2"},
        {"sharding_strategy": "hybrid_shard"},
        {"sharding_strategy": torch.distributed.fsdp.ShardingStrategy.HYBRID_SHARD},
    ],
)
def test_fsdp_fp8_strategy_refuses_hybrid_sharding_when_built(kwargs):
    # Accepted before: on CPUs torch fell back to NO_SHARD in one-process groups and every rank trained apart (the
    # FP8 hook reduced over the same group); on GPUs FSDP refused the hook with a bare AssertionError.
    with pytest.raises(ValueError, match=r"shards over all processes: use sharding_strategy 'FULL_SHARD'"):
        FP8FSDPStrategy(**kwargs)
    with pytest.raises(ValueError, match=r"sharding_strategy='bogus' is not one of 'FULL_SHARD'"):
        FP8FSDPStrategy(sharding_strategy="bogus")  # Lightning's own lookup: a bare KeyError('BOGUS')
    for name in ("FULL_SHARD", "shard_grad_op", "NO_SHARD"):
        assert FP8FSDPStrategy(sharding_strategy=name).sharding_strategy.name == name.upper()


def test_fsdp_fp8_strategy_refuses_a_device_mesh_that_trains_processes_apart_and_a_sharding_strategy_of_another_type():
    # Lightning passes device_mesh to FSDP with FULL_SHARD, which (without hybrid sharding) takes the mesh's first
    # dimension as its process group: under (1, 2) each process sharded with itself alone and trained apart (the two
    # ranks' weights differed after a fit), and that was the mesh this check let through, while it refused (2, 1),
    # which trains as without a mesh (test_distributed.py). An int mesh failed in Lightning at fit ("'int' object has
    # no attribute 'get_group'"); a list reached FSDP unconverted (Lightning builds a DeviceMesh from a tuple only). An
    # int sharding strategy failed in Lightning ("'int' object has no attribute 'name'").
    for mesh in ((2, 4), (1, 2), [1, 2], (2, 1, 2)):
        with pytest.raises(
            ValueError, match=r"device_mesh=\([\d, ]+\) has processes along a dimension after the first"
        ):
            FP8FSDPStrategy(device_mesh=mesh)
    assert FP8FSDPStrategy(device_mesh=(2, 1)).kwargs["device_mesh"] == (2, 1)
    assert FP8FSDPStrategy(device_mesh=[2]).kwargs["device_mesh"] == (2,)
    for mesh in (2, (2, 0), (True,), (), "2"):
        with pytest.raises(TypeError, match=r"device_mesh=.* must be a"):
            FP8FSDPStrategy(device_mesh=mesh)
    with pytest.raises(TypeError, match="sharding_strategy must be a name or a torch.distributed.fsdp.Sharding"):
        FP8FSDPStrategy(sharding_strategy=7)


def test_fsdp_fp8_strategy_checks_use_orig_params_and_a_none_sharding_strategy(recwarn, monkeypatch):
    # use_orig_params=False trained with fp32 states for every parameter (FP8AdamW cannot tell the FP8 weights inside
    # flat parameters): an O2 recipe's states were dropped without a word; "no" was stored as given; an explicit
    # sharding_strategy=None failed inside Lightning ("'NoneType' object has no attribute 'name'").
    import lightning_fp8.warnings

    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    with pytest.raises(TypeError, match=r"use_orig_params='no'\): must be True or False"):
        FP8FSDPStrategy(use_orig_params="no")
    FP8FSDPStrategy(use_orig_params=False)
    assert [w for w in recwarn if "use_orig_params=False: FP8AdamW sees FSDP's flat parameters" in str(w.message)]
    recwarn.clear()
    assert FP8FSDPStrategy().kwargs["use_orig_params"] is True
    assert not [w for w in recwarn if "use_orig_params" in str(w.message)]
    with pytest.raises(TypeError, match="sharding_strategy=None: give 'FULL_SHARD'"):
        FP8FSDPStrategy(sharding_strategy=None)


def test_fsdp_fp8_strategy_refuses_cpu_offload_on_the_cpu():
    # torch failed deep in FSDP's setup ("Cannot access accelerator device when none is available").
    strategy = FP8FSDPStrategy(cpu_offload=True)
    with pytest.raises(ValueError, match=r"FP8FSDPStrategy\(cpu_offload=True\) moves GPU parameters to the CPU"):
        strategy._setup_model_on_cpu(torch.nn.Linear(16, 16))


def test_fsdp_fp8_strategy_implies_fp8_precision():
    for strategy in ("fsdp_fp8", FP8FSDPStrategy()):
        trainer = L.Trainer(strategy=strategy, devices=1, **TRAINER)
        assert isinstance(trainer.strategy, FP8FSDPStrategy)
        assert isinstance(trainer.precision_plugin, FP8LMPrecision)
    with pytest.raises(TypeError, match="needs the FP8LMPrecision plugin"):
        FP8FSDPStrategy().precision_plugin = MixedPrecision("bf16-mixed", "cpu")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_classes_pickle_for_spawned_processes(namespace):
    plugin = pickle.loads(pickle.dumps(precision_class(namespace)(recipe="fp8-lm-e4m3")))
    assert type(plugin) is precision_class(namespace) and plugin.recipe.fp8_format == "e4m3"
    assert pickle.loads(pickle.dumps(strategy_class(namespace))) is strategy_class(namespace)


def test_lightning_cli_accepts_the_precision_string_and_the_plugin(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the test extra)")
    from lightning.pytorch.cli import LightningCLI

    from tests.integrations.lightning.gpt_tiny import GPTModule

    common = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
    cli = LightningCLI(GPTModule, run=False, args=["--trainer.precision=fp8-lm-current", *common])
    assert isinstance(cli.trainer.precision_plugin, FP8LMPrecision)
    assert cli.trainer.precision_plugin.recipe.scaling == "current"
    args = ["--trainer.plugins=lightning_fp8.FP8LMPrecision", "--trainer.plugins.recipe=fp8-lm-o1", *common]
    cli = LightningCLI(GPTModule, run=False, args=args)
    assert cli.trainer.precision_plugin.recipe.opt_level == "O1"


@pytest.mark.skipif("pytorch_lightning" not in NAMESPACES, reason="pytorch_lightning is not installed")
def test_pytorch_lightning_trainer_fits_in_fp8(monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    import pytorch_lightning as pl
    import torch

    from lightning_fp8 import FP8AdamW, FP8Linear
    from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor
    from tests.integrations.lightning.gpt_tiny import GPTConfig, TinyGPT, loader

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyGPT(GPTConfig())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    scale, health = FP8ScaleMonitor(log_every_n_steps=1), TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    trainer = pl.Trainer(precision="fp8-lm", max_steps=2, callbacks=[scale, health], **TRAINER)
    with pytest.warns(UserWarning, match="no logger"):
        trainer.fit(module, loader())
    assert all(isinstance(m, FP8Linear) for m in module.modules() if isinstance(m, torch.nn.Linear))
    assert isinstance(trainer.optimizers[0], FP8AdamW)
    assert "fp8/input/scale_min" in scale.last_metrics and "health/grad_norm" in health.last_metrics  # callbacks too


@pytest.mark.parametrize(
    ("target", "match"),
    [("trainer", r"could not register precision='fp8-lm'.*plugins=\[lightning_fp8"),
     ("fabric", r"could not hook into lightning.fabric.connector.*the Trainer works")],
)  # fmt: skip
def test_moved_internals_warn_instead_of_breaking_the_import(monkeypatch, target, match):
    class Connector:  # a future Lightning whose connectors no longer take `precision` and `plugins` here
        def _check_config_and_set_final_flags(self, strategy, accelerator):
            pass

    fake = type(sys)("fake_connector")
    fake._AcceleratorConnector = fake._Connector = Connector
    if target == "trainer":
        monkeypatch.setattr(registry, "_connector_module", lambda namespace: fake)
    else:  # Fabric's alone: the Trainer stays registered
        real_import, fabric_modules = importlib.import_module, registry._FABRIC_CONNECTOR.values()
        monkeypatch.setattr(registry.importlib, "import_module",
                            lambda name: fake if name in fabric_modules else real_import(name))  # fmt: skip
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    with pytest.warns(UserWarning, match=match):
        registry.register()
    assert not getattr(Connector._check_config_and_set_final_flags, registry._MARK, False)
    assert registry.is_registered("lightning") == (target == "fabric")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_fabric_internals_are_where_the_registry_expects_them(namespace):
    # If this fails, Lightning moved the Fabric code registry.py hooks into (to refuse FP8 precisions when Fabric is
    # built): update registry.py for the new version.
    connector = importlib.import_module(registry._FABRIC_CONNECTOR[namespace])._Connector
    method = connector._check_config_and_set_final_flags
    assert getattr(method, registry._MARK, False), "not hooked"
    assert {"precision", "plugins"} <= set(inspect.signature(inspect.unwrap(method)).parameters)


def test_fabric_takes_its_plugins_as_an_iterator():
    """The refusal's wrapper read Fabric(plugins=...) and handed Fabric the used-up iterator: its plugins were lost."""
    from lightning.fabric.plugins import HalfPrecision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=iter([HalfPrecision("bf16-true")]))
    assert isinstance(fabric._precision, HalfPrecision)


@pytest.mark.parametrize("name", ["FSDP_FP8", "Fsdp_Fp8"])
def test_fsdp_fp8_strategy_name_is_case_insensitive_as_in_lightning(name):
    # Lightning lowercases strategy names: "FSDP_FP8" is fsdp_fp8 and implies the FP8 precision as well.
    trainer = L.Trainer(strategy=name, devices=1, **TRAINER)
    assert isinstance(trainer.strategy, FP8FSDPStrategy)
    assert isinstance(trainer.precision_plugin, FP8LMPrecision)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp8-lm-o1", "strategy": "deepspeed"}, r"^precision='fp8-lm-o1' does not support strategy="),
        (
            {"plugins": [FP8LMPrecision("fp8-lm-e4m3")], "strategy": "fsdp"},
            r"^FP8LMPrecision\(recipe='fp8-lm-e4m3'\) does not support strategy='fsdp'",
        ),
        (
            {"plugins": [FP8LMPrecision(FP8Recipe(margin=3))], "strategy": FSDPStrategy()},
            r"^FP8LMPrecision\(\.\.\.\) does not support strategy=FSDPStrategy\(\.\.\.\)",
        ),
    ],
)
def test_unsupported_strategy_errors_name_the_precision_that_was_passed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(**kwargs, **TRAINER)
