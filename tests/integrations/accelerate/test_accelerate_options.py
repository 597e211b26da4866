"""Accelerate's own Accelerator options combined with FP8-LM: each is honoured as plain Accelerate honours it, or
refused with an error that says what to do, never ignored without a word."""

import pytest
from accelerate.utils import GradScalerKwargs
from torch import nn

from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate import cli
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def test_grad_scaler_kwargs_are_refused_with_fp8_lm_since_mu_would_ignore_them():
    # GradScalerKwargs sets up the fp16 GradScaler; under FP8-LM the loss is scaled by mu, whose init_scale and
    # growth_interval stayed at their defaults while the script believed it had set them.
    with pytest.raises(ValueError, match=r"GradScalerKwargs.*FP8GradScaler\(init_scale=") as error:
        Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    assert "init_scale=1024.0" in str(error.value)  # names what was passed


def test_grad_scaler_kwargs_stay_accelerates_business_without_fp8_lm():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="none", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    assert accelerator.scaler_handler.init_scale == 1024.0
    model = nn.Linear(16, 16)
    accelerator.prepare(model)


def test_a_config_key_accelerate_does_not_take_is_named_in_the_users_file_before_launching(tmp_path, capsys):
    # Accelerate refused it in the copy without the lightning_fp8 section, naming that temporary file in a traceback.
    path = tmp_path / "train.yaml"
    path.write_text("distributed_type: 'NO'\ngradient_accumulation_steps: 3\nlightning_fp8: fp8-lm\n")
    assert cli.main(["launch", "--config_file", str(path), str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert f"config file {path} has key(s) ['gradient_accumulation_steps']" in err, err
    assert "in the script" in err and "Traceback" not in err


def test_old_config_keys_accelerate_still_reads_are_not_refused(tmp_path, capsys):
    # fp16 and dynamo_backend: Accelerate's process_config turns them into mixed_precision and dynamo_config.
    path = tmp_path / "train.yaml"
    path.write_text("distributed_type: 'NO'\nfp16: false\ndynamo_backend: 'NO'\nlightning_fp8: fp8-lm\n")
    cli.main(["launch", "--config_file", str(path), str(tmp_path / "missing.py")])
    assert "has key(s)" not in capsys.readouterr().err
