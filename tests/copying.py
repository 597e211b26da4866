"""A module (or any picklable object) copied the three ways users copy one: ``copy.deepcopy``, ``pickle`` and
``torch.save`` / ``torch.load(weights_only=False)`` of the whole object. Shared by the route sweeps that check a copy
carries the FP8 state (test_routes_layouts.py, test_routes_scaling.py, test_routes_module_protocol.py)."""

import copy
import io
import pickle

import torch

COPY_ROUTES = ("deepcopy", "pickle", "torch.save")


def copy_by(obj, how: str):
    """``obj`` copied by ``how``, one of :data:`COPY_ROUTES`."""
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    if how != "torch.save":
        raise ValueError(f"copy_by(how={how!r}): one of {COPY_ROUTES}")
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
