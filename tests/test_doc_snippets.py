"""Every ```python block of the documentation pages runs as written, on CPU, in a fresh namespace.

A block runs after the scaffolding its page implies (a small model, a loader, a LightningModule: ``PRELUDES``) and
after the earlier blocks it continues (``CONTINUES``). A top-level expression whose comment shows a Python literal
(``fp8_max(E4M3), fp8_max(E5M2)  # (448.0, 57344.0)``) must produce that value. Blocks included from
``examples/`` (``--8<--``) are run by tests/test_examples.py; blocks that need several GPUs or a process group are
in ``SKIP`` with the reason, and ``test_skipped_blocks_name_real_signatures`` binds their calls to the real
signatures instead, so a renamed argument or a removed function still fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
PAGES = [
    p.relative_to(DOCS).as_posix()
    for pattern in ("*.md", "guides/*.md", "concepts/*.md")
    for p in sorted(DOCS.glob(pattern))
    if p.name != "benchmarks.md"  # measured results, no code to run
]
_FENCE = re.compile(r"^(?P<indent>[ ]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of ``docs/<page>``, dedented, in order (the index a failure names)."""
    return [textwrap.dedent(m["body"]) for m in _FENCE.finditer((DOCS / page).read_text())]


# Scaffolding a block's surrounding text implies; feature sizes are multiples of 16 so every layer runs in FP8.
_TINY = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
loader = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(4)]
loss_fn = nn.MSELoss()
"""
_FP8_STEPPED = """
from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
model = convert_to_fp8(model)
scaler = FP8GradScaler(model=model)
optimizer = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
scaler.scale_loss(loss_fn(model(loader[0][0]), loader[0][1])).backward()
optimizer.step()
optimizer.zero_grad()
"""
_TINY_GPT = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from gpt import GPT, GPTConfig
cfg = GPTConfig(seq_len=16, depth=1, width=32, heads=2)
"""
_LIGHTNING = """
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step + 1 >= 2:  # the pages' Trainers run max_steps=1000 or without a limit: two steps do
            self.trainer.should_stop = True
        return nn.functional.mse_loss(self.model(x).float(), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 32), torch.randn(16, 16)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

model = my_lightning_module = TinyModule()
"""
_ACCELERATE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.body(x).float(), y)

model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(32, 32), torch.randn(32, 16))
loader = torch.utils.data.DataLoader(data, batch_size=8)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
"""
_FALLEN_BACK = """
import torch
from torch import nn
from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

def build_model():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

model = convert_to_fp8(build_model())
scaler = FP8GradScaler(nonfinite_fallback="bf16", model=model)  # 3 non-finite steps put the layers back to bf16
optimizer = FP8AdamW(model.parameters(), grad_scaler=scaler)
x = torch.randn(8, 32)
for i in range(4):
    loss = model(x).square().mean() * (float("inf") if i < 3 else 1.0)
    scaler.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad()
from lightning_fp8.recovery import fallen_back_layers
assert fallen_back_layers(model), "the prelude meant to make layers fall back"
path = "ckpt.pt"
"""

PRELUDES: dict[tuple[str, int], str] = {
    ("accelerate.md", 0): _ACCELERATE,
    ("getting-started.md", 0): _LIGHTNING,
    ("getting-started.md", 1): _TINY,
    ("index.md", 0): _LIGHTNING,
    ("guides/checkpoints.md", 0): _TINY + _FP8_STEPPED,
    ("guides/checkpoints.md", 4): _TINY_GPT
    + "from lightning_fp8 import convert_to_fp8\ntorch.save(GPT(cfg).state_dict(), 'pretrained.pt')\n",
    ("guides/checkpoints.md", 5): _TINY + _FP8_STEPPED + "layer = model[0]\ndelta = 0.01 * torch.randn(64, 32)\n",
    ("guides/lightning.md", 0): _LIGHTNING,
    ("guides/lightning.md", 1): _LIGHTNING,
    ("guides/monitoring.md", 0): _TINY_GPT
    + """
from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
model = convert_to_fp8(GPT(cfg), module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
grad_scaler = FP8GradScaler(model=model)
optimizer = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=grad_scaler)
idx = torch.randint(0, 256, (4, 16))
grad_scaler.scale_loss(model(idx, idx)[1]).backward()
optimizer.step()
""",
    ("guides/monitoring.md", 1): "import lightning as L\n",
    ("guides/monitoring.md", 2): _TINY + "from lightning_fp8 import convert_to_fp8\nmodel = convert_to_fp8(model)\n",
    ("guides/troubleshooting.md", 0): _FALLEN_BACK,
    ("concepts/gemms.md", 0): """
from collections import OrderedDict
from torch import nn
model = nn.Sequential(OrderedDict(fc=nn.Linear(32, 64), act=nn.GELU(), lm_head=nn.Linear(64, 16)))
""",
    ("concepts/formats.md", 1): "from lightning_fp8 import FP8Recipe\n",
    ("concepts/gradient-scaling.md", 0): _TINY
    + """
from lightning_fp8 import convert_to_fp8
model = convert_to_fp8(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = loss_fn(model(loader[0][0]), loader[0][1])
""",
    ("concepts/gradient-scaling.md", 1): """
optimizer.zero_grad()
opt1 = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
opt2 = torch.optim.SGD(model[2].parameters(), lr=1e-3)
loss = loss_fn(model(loader[1][0]), loader[1][1])
""",
}
# A block that continues earlier blocks of its page runs after them (and their preludes), in one namespace.
CONTINUES: dict[tuple[str, int], list[int]] = {("concepts/gradient-scaling.md", 1): [0]}
# Blocks reading the checkpoint of examples/train_gpt.py at its default path (runs/train_gpt/checkpoints/last.ckpt).
NEEDS_TRAIN_GPT_CKPT = {("guides/checkpoints.md", 2), ("guides/checkpoints.md", 3)}
# Runs with FP8-LM turned on, as a launch by `lightning-fp8 launch --fp8-recipe fp8-lm` would.
ENV: dict[tuple[str, int], dict[str, str]] = {("accelerate.md", 0): {"LIGHTNING_FP8_RECIPE": "fp8-lm"}}

_GPU_ONLY = "needs several GPUs (NCCL); its names and arguments are checked by test_skipped_blocks_name_real_signatures"
SKIP: dict[tuple[str, int], str] = {
    ("guides/checkpoints.md", 1): "DCP with sync_fp8_amax, a collective: needs an initialized process group; "
    "its names and arguments are checked by test_skipped_blocks_name_real_signatures",
    ("guides/lightning.md", 4): "ModelParallelStrategy(tensor_parallel_size=2) on 2 GPUs; " + _GPU_ONLY,
    ("guides/pytorch.md", 3): "init_process_group('nccl') and .cuda(); " + _GPU_ONLY,
    ("concepts/distributed.md", 0): "ProcessGroupNCCL high-priority groups; " + _GPU_ONLY,
}

# The blocks run here: not the ones included from examples/ (tests/test_examples.py runs those scripts), nor SKIP's
# (test_skipped_blocks_name_real_signatures checks those).
CASES = [
    (page, i)
    for page in PAGES
    for i, block in enumerate(python_blocks(page))
    if not block.lstrip().startswith("--8<--") and (page, i) not in SKIP
]


def _shown_value(source_line: str, node: ast.expr) -> tuple[bool, object]:
    """The literal a ``# comment`` after a one-line expression shows as its value, if it is one."""
    if node.lineno != node.end_lineno:
        return False, None
    comment = source_line[node.end_col_offset :].strip()
    if not comment.startswith("#") or "..." in comment:
        return False, None
    try:
        return True, ast.literal_eval(comment[1:].strip())
    except (ValueError, SyntaxError):
        return False, None  # prose, not a value


def run_block(source: str, namespace: dict, where: str) -> None:
    """exec ``source`` statement by statement; a shown literal value must equal the expression's."""
    lines = source.splitlines()
    for stmt in ast.parse(source, filename=where).body:
        code = compile(ast.Module([stmt], type_ignores=[]), where, "exec")
        if not isinstance(stmt, ast.Expr):
            exec(code, namespace)
            continue
        shown, expected = _shown_value(lines[stmt.lineno - 1], stmt.value)
        value = eval(compile(ast.Expression(stmt.value), where, "eval"), namespace)
        if shown:
            got = set(value) if isinstance(expected, set) and isinstance(value, dict) else value
            assert got == expected, f"{where} line {stmt.lineno}: the page shows {expected!r}, the code gives {got!r}"


@pytest.fixture(scope="module")
def train_gpt_run(tmp_path_factory) -> Path:
    """A directory holding runs/train_gpt/checkpoints/last.ckpt, written by examples/train_gpt.py at tiny size."""
    cwd = tmp_path_factory.mktemp("train_gpt")
    args = "--toy --max-steps 2 --max-bytes 60000 --width 32 --depth 1 --heads 2 --seq-len 16 --batch-size 4"
    args += " --val-every 2 --val-batches 1 --no-progress-bar"
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), *args.split()]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cwd


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons: each block gets its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize(("page", "index"), CASES, ids=[f"{page}[{i}]" for page, i in CASES])
def test_doc_block_runs(page, index, tmp_path, monkeypatch, request):
    blocks = python_blocks(page)
    monkeypatch.chdir(request.getfixturevalue("train_gpt_run") if (page, index) in NEEDS_TRAIN_GPT_CKPT else tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))  # `from gpt import GPT` (examples/gpt.py), as the pages say
    for name, value in ENV.get((page, index), {}).items():
        monkeypatch.setenv(name, value)
    if page == "accelerate.md":
        request.getfixturevalue("fresh_accelerate_state")
    namespace: dict = {"__name__": "__doc_snippet__"}
    for i in [*CONTINUES.get((page, index), []), index]:
        exec(PRELUDES.get((page, i), ""), namespace)
        run_block(blocks[i], namespace, f"docs/{page} python block {i}")


def _bind(fn, *args, **kwargs) -> None:
    inspect.signature(fn).bind(*args, **kwargs)


def test_skipped_blocks_name_real_signatures():
    """The skipped blocks' imports exist and their calls bind to the signatures (without running them)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed import FP8CommState, enable_fp8_ddp, fp8_allreduce_hook
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync, sync_fp8_amax
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    assert set(SKIP) == {("guides/checkpoints.md", 1), ("guides/lightning.md", 4), ("guides/pytorch.md", 3),
                         ("concepts/distributed.md", 0)}  # fmt: skip
    x = object()
    # guides/checkpoints.md [1]
    _bind(sync_fp8_amax, x)
    _bind(get_state_dict, x, x)
    _bind(dcp.save, {}, checkpoint_id="path")
    _bind(dcp.load, {}, checkpoint_id="path")
    _bind(set_state_dict, x, x, model_state_dict={}, optim_state_dict={})
    _bind(fp8_state_dict, x)
    _bind(load_fp8_state_dict, x, {})
    # guides/lightning.md [4]
    _bind(ModelParallelStrategy, tensor_parallel_size=2)
    _bind(convert_to_fp8, x)
    _bind(apply_fp8_tensor_parallel, x, x)
    # guides/pytorch.md [3]
    _bind(dist.init_process_group, "nccl")
    _bind(convert_to_fp8, x, module_filter_fn=x)
    _bind(FP8GradScaler, model=x)
    _bind(FP8AdamW, x, lr=3e-4, grad_scaler=x)
    _bind(DDP, x)
    _bind(enable_fp8_ddp, x, x)
    _bind(FP8CommState, x, grad_scaler=x)
    _bind(enable_fp8_amax_sync, x)
    # concepts/distributed.md [0] (dist.ProcessGroupNCCL exists only in CUDA builds of torch)
    _bind(dist.new_group, backend="nccl", pg_options=x)
    _bind(DDP, x, process_group=x)
    _bind(FP8CommState, x, algorithm="native", amax_group=x)
    _bind(DDP.register_comm_hook, x, x, fp8_allreduce_hook)
