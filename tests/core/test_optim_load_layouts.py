"""FP8AdamW.load_state_dict of states read into this optimizer's own layout (torch.distributed.checkpoint casts each
saved tensor to the template's dtype), and of a checkpoint read onto the meta device."""

import io
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim.state_layout import dequantize


def _trained(**options):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
    opt = FP8AdamW(model.parameters(), lr=1e-2, **options)
    for i in range(3):
        model(torch.randn(6, 32, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _states(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def _same(before, opt):
    after = list(opt.state.values())
    return len(before) == len(after) and all(
        b.keys() == a.keys()
        and all(torch.equal(b[k].float().nan_to_num(1e30), a[k].float().nan_to_num(1e30)) for k in b)
        for b, a in zip(before, after, strict=True)
    )


@pytest.mark.parametrize("cut_to", ["max", "nan"])
@pytest.mark.parametrize("saved_dtype", [torch.float16, torch.float8_e5m2])
def test_a_wider_state_read_into_an_e4m3_template_is_refused(tmp_path, saved_dtype, cut_to):
    """A DCP checkpoint of fp16 (or E5M2) first moments read into the default O2 optimizer's E4M3 template: DCP cuts
    the stored values at 448 (torch 2.13; 2.11 makes them NaN) and keeps the wider format's scale; the moments loaded
    about 50x too small, silently (or were refused as a diverged run's). Now refused (amax * scale above E4M3's
    maximum); the load changes nothing more than DCP's read did. The same states loaded through
    state_dict()/load_state_dict() convert by value."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = _trained(exp_avg_dtype=saved_dtype)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
        restored, restored_opt = _trained()
        model_sd, optim_sd = get_state_dict(restored, restored_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(tmp_path))  # into the optimizer's own state tensors
        if cut_to == "nan":  # torch 2.11 casts what E4M3 cannot hold to NaN, 2.13 to its maximum
            for s in restored_opt.state.values():
                if "exp_avg_scale" in s:
                    values = s["exp_avg"].float()
                    s["exp_avg"].copy_(values.masked_fill(values.abs() >= 448, float("nan")))
        before = _states(restored_opt)
        with pytest.raises(ValueError, match=r"'exp_avg_amax' times 'exp_avg_scale' is above .*settings of the run"):
            set_state_dict(restored, restored_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert _same(before, restored_opt)
        restored_opt.load_state_dict(opt.state_dict())  # by value
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        if "exp_avg_scale" in opt.state[p]:
            want, got = dequantize(opt.state[p], "exp_avg"), dequantize(restored_opt.state[q], "exp_avg")
            assert torch.allclose(got, want, rtol=2**-3, atol=want.abs().max().item() * 2**-8)


def test_a_checkpoint_read_onto_meta_says_how_to_load_it():
    model, opt = _trained()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    on_meta = torch.load(buf, weights_only=True, map_location="meta")
    before = _states(opt)
    with pytest.raises(ValueError, match=r"on the meta device.*map_location='cpu'"):
        opt.load_state_dict(on_meta)
    assert _same(before, opt)
