"""A recipe whose strings come from NumPy (or a str enum, as configuration systems give) trains, checkpoints and
resumes with ``ckpt_path=`` exactly as the same recipe written with plain strings."""

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fp8 import FP8Recipe
from lightning_fp8.integrations.lightning import FP8LMPrecision
from tests.integrations.lightning.gpt_tiny import GPTModule, loader


class StepIndexed(GPTModule):
    """Trains on batch number ``global_step``: the data then depends only on what the checkpoint restores."""

    def training_step(self, batch, batch_idx):
        return super().training_step(self.batches[self.global_step], batch_idx)


def _fit(recipe: FP8Recipe, root, ckpt_path=None, seed: int = 0) -> StepIndexed:
    torch.manual_seed(seed)
    module = StepIndexed()
    module.batches = list(loader())
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[FP8LMPrecision(recipe)],
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module


def test_a_recipe_of_numpy_strings_resumes_as_the_recipe_of_plain_strings(tmp_path):
    # The NumPy strings stayed in the recipe, and the plugin's checkpoint state pickled them: Lightning's resume, which
    # reads the checkpoint with weights_only=True, failed with an UnpicklingError.
    plain = _fit(FP8Recipe(scaling="current", opt_level="O1"), tmp_path / "plain")
    numpy_recipe = FP8Recipe(scaling=np.str_("current"), opt_level=np.str_("O1"))
    uninterrupted = _fit(numpy_recipe, tmp_path / "numpy")
    assert uninterrupted.losses == plain.losses
    checkpoint = tmp_path / "numpy" / "epoch=0-step=2.ckpt"
    assert torch.load(checkpoint, weights_only=True)["FP8LMPrecision"]["recipe"] == numpy_recipe.to_dict()
    resumed = _fit(numpy_recipe, tmp_path / "resumed", ckpt_path=checkpoint, seed=123)
    assert resumed.losses == uninterrupted.losses[2:]
