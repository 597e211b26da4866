"""Counts, for each autograd Function forward traced by torch.compile, how many of its nodes evaluated to the
Function's output tensor itself (see tests/core/test_compiled_function_outputs.py for why it must be one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx


@contextlib.contextmanager
def forward_outputs() -> Iterator[list[tuple[torch.Tensor, int]]]:
    """Patches the FX interpreter (dynamo's eager backend runs an autograd Function's traced forward in one) while
    open: each run whose output has a traced Function forward's form (``(outputs, saved)``) is recorded as (the first
    output, the number of the graph's non-placeholder nodes that evaluated to that tensor)."""
    runs, values = [], {}
    run, run_node = torch.fx.Interpreter.run, torch.fx.Interpreter.run_node

    def recording_run_node(self, node):
        out = run_node(self, node)
        if isinstance(out, torch.Tensor) and node.op != "placeholder":
            values.setdefault(id(self), []).append(out)
        return out

    def recording_run(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        nodes = values.pop(id(self), [])
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], tuple) and out[0]:
            y = out[0][0]
            runs.append((y, sum(v is y for v in nodes)))
        return out

    torch.fx.Interpreter.run_node, torch.fx.Interpreter.run = recording_run_node, recording_run
    try:
        yield runs
    finally:
        torch.fx.Interpreter.run_node, torch.fx.Interpreter.run = run_node, run
