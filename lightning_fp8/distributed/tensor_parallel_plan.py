"""The Megatron plan of :func:`~lightning_fp8.distributed.tensor_parallel.apply_fp8_tensor_parallel`: which
submodules of a transformer block are sharded column-wise, row-wise or run as (sequence-parallel) norms, how the
blocks are found in a model, and the checks of the other arguments, all made before the first layer changes."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Literal

from torch import nn
from torch.distributed.tensor import DeviceMesh

from lightning_fp8.distributed.comm import check_group
from lightning_fp8.recipe import check_flag

Role = Literal["colwise", "rowwise", "norm"]
_SHARDABLE = (nn.Linear, nn.Embedding)  # what a colwise or rowwise plan entry can name

# Submodule names inside one transformer block -> role. "gpt": a fused QKV projection whose output is laid out per
# head ([q_h k_h v_h] for each head h, so a column shard holds whole heads), as in Megatron-LM.
GPT_PLAN: dict[str, Role] = {
    "ln_1": "norm",
    "attn.qkv": "colwise",
    "attn.proj": "rowwise",
    "ln_2": "norm",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}
# Hugging Face Llama/Mistral names. Separate q/k/v (and gate/up) projections each gather their input.
LLAMA_PLAN: dict[str, Role] = {
    "input_layernorm": "norm",
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "post_attention_layernorm": "norm",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
PLANS: dict[str, dict[str, Role]] = {"gpt": GPT_PLAN, "llama": LLAMA_PLAN}


def resolve_plan(plan: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(
                f"apply_fp8_tensor_parallel(plan={plan!r}): unknown plan; use one of {sorted(PLANS)} "
                "or a mapping from submodule name (inside a block) to 'colwise', 'rowwise' or 'norm'"
            )
        return dict(PLANS[plan])
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"apply_fp8_tensor_parallel(plan=...) got a {type(plan).__name__}: pass a plan name ({sorted(PLANS)}) or a "
            "mapping from submodule name (inside a block) to 'colwise', 'rowwise' or 'norm'"
        )
    bad = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise", "norm")}
    if bad or not plan:
        raise ValueError(
            f"apply_fp8_tensor_parallel(plan={dict(plan)}): roles must be 'colwise', 'rowwise' or 'norm' "
            f"(got {bad or 'an empty plan'})"
        )
    return dict(plan)


def find_blocks(module: nn.Module, roles: Mapping[str, str]) -> list[str]:
    """Qualified names of the submodules (``module`` included) that contain every submodule the plan names, each
    ``colwise`` or ``rowwise`` one an ``nn.Linear`` (FP8Linear) or ``nn.Embedding``.

    A submodule whose names match but whose targets cannot be sharded is not a block: an ``nn.Sequential`` of
    ``nn.Sequential`` blocks has children ``"0"`` and ``"2"`` too, as each block does.

    Raises:
        ValueError: if no submodule contains every name of the plan.
        TypeError: if some do, but none holds a shardable layer under each of them (the plan names another kind).
    """
    # refused: (unshardable targets, module, first such plan entry) of the closest match that is not a block
    blocks, refused = [], None
    for fqn, m in module.named_modules():
        try:
            targets = {name: m.get_submodule(name) for name in roles}
        except AttributeError:
            continue
        unshardable = [n for n, t in targets.items() if roles[n] != "norm" and not isinstance(t, _SHARDABLE)]
        if not unshardable:
            blocks.append(fqn)
        elif refused is None or len(unshardable) < refused[0]:
            refused = (len(unshardable), fqn, unshardable[0])
    if not blocks and refused is not None:
        _, fqn, name = refused
        target = module.get_submodule(f"{fqn}.{name}" if fqn else name)
        raise TypeError(
            f"apply_fp8_tensor_parallel: plan entry {name!r} ({roles[name]}) is a {type(target).__name__} in "
            f"{fqn or type(module).__name__}; only nn.Linear (FP8Linear) and nn.Embedding can be sharded"
        )
    if not blocks:
        raise ValueError(
            f"apply_fp8_tensor_parallel: no submodule of {type(module).__name__} contains all of "
            f"{sorted(roles)}; pass plan= with the names your blocks use"
        )
    return blocks


def check_arguments(module: Any, tp_mesh: Any, flags: Mapping[str, Any], seq_dim: Any, amax_sync_group: Any) -> None:
    """Raise for an argument of ``apply_fp8_tensor_parallel`` other than the plan: a mesh that is no 1-D DeviceMesh
    (ValueError), a module that is no ``nn.Module``, a flag that is no bool, a ``seq_dim`` that is no int and an
    ``amax_sync_group`` that is no process group (TypeError), or one that this rank is not a member of (ValueError)."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(f"apply_fp8_tensor_parallel(tp_mesh={tp_mesh}): pass a 1-D DeviceMesh (e.g. mesh['tp'])")
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_fp8_tensor_parallel(module=...) got a {type(module).__name__}: pass the model")
    for name, flag in flags.items():
        check_flag("apply_fp8_tensor_parallel", name, flag)
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, numbers.Integral):
        raise TypeError(f"apply_fp8_tensor_parallel(seq_dim={seq_dim!r}): must be an int (the sequence dimension)")
    check_group(
        amax_sync_group,
        "apply_fp8_tensor_parallel(amax_sync_group=...)",
        "every rank passes a group it belongs to (e.g. mesh['dp'].get_group()), or None for the world",
    )
