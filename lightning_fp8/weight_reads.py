"""Which sub-layers' weights a module's own forward reads, from its source: code that computes with a linear layer's
weight itself (Mamba's ``self.dt_proj.weight @ x``) or casts a tensor to its dtype (T5's ``x.to(self.wo.weight.dtype)``)
bypasses an FP8 layer there, and at O2 would meet FP8AdamW's scaled fp16 master (lightning_fp8/eligibility.py)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Iterator, Mapping

from torch import nn

# Attributes of a weight that use none of its values (its dtype does where a tensor is cast to it: "dtype_cast").
_WEIGHT_METADATA = frozenset(
    {"dtype", "device", "shape", "size", "ndim", "dim", "numel", "requires_grad", "requires_grad_", "is_meta", "grad"}
)


@functools.cache
def forward_weight_reads(cls: type) -> Mapping[str, str]:
    """The paths ``p`` for which the forward of ``cls`` (its ``forward`` and the methods of ``cls`` it names, as
    Mamba's calls ``self.cuda_kernels_forward``) reads ``self.<p>.weight`` itself (directly or through a local name
    bound to ``self.<p>``; ``p`` is ``"<container>.*"`` for ``self.<container>[k].weight``, any layer the container
    holds, as PEFT's ``lora_A = self.lora_A[adapter]``), read from the source: ``p`` ->
    ``"weight_read"`` where it computes with it (``self.dt_proj.weight @ x``), ``"dtype_cast"`` where it casts a tensor
    to its dtype (``x.to(self.wo.weight.dtype)``); other metadata (``.shape``, ``isinstance``) aside. Other methods (a
    LoRA layer's ``merge``, initialization) run outside the training step. Empty where the source cannot be read."""
    methods: dict[str, types.FunctionType] = {}
    for klass in reversed(cls.__mro__):  # a subclass's method replaces its base's
        if klass is nn.Module or klass is object:
            continue
        for name, attr in vars(klass).items():
            fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            try:
                fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else None  # functools.wraps decorators
            except ValueError:  # a __wrapped__ cycle
                fn = None
            if isinstance(fn, types.FunctionType):
                methods[name] = fn
    reached, todo = set(), ["forward"]
    while todo:  # the methods the forward may call: those whose name its code (or theirs) uses
        name = todo.pop()
        if name in methods and name not in reached:
            reached.add(name)
            todo.extend(_names(methods[name].__code__))
    found: dict[str, str] = {}
    for name in reached:
        fn = methods[name]
        if "weight" not in _names(fn.__code__):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except Exception:  # no source to read (a REPL, generated code): a best effort, never a failed conversion
            continue
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.ctx, ast.Load):
                path, parent = _self_path(node.value, aliases), parents.get(node)
                if path is None or _is_type_check(parent):
                    continue
                if isinstance(parent, ast.Attribute) and parent.attr == "dtype" and _is_cast_argument(parent, parents):
                    found.setdefault(path, "dtype_cast")
                elif not (isinstance(parent, ast.Attribute) and parent.attr in _WEIGHT_METADATA):
                    found[path] = "weight_read"
    return types.MappingProxyType(found)  # cached: read-only


def _is_type_check(node: ast.AST | None) -> bool:
    # isinstance(self.wo.weight, torch.Tensor), hasattr(self.wo.weight, ...): no value read.
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "hasattr")


def _is_cast_argument(node: ast.expr, parents: dict[ast.AST, ast.AST]) -> bool:
    # node (self.wo.weight.dtype) is an argument of a tensor cast: x.to(node), x.to(dtype=node), x.type(node), or of a
    # helper named for one (PEFT's self._cast_input_dtype(x, lora_A.weight.dtype)).
    parent = parents.get(node)
    if isinstance(parent, ast.keyword):
        parent = parents.get(parent)
    if not isinstance(parent, ast.Call):
        return False
    name = parent.func.attr if isinstance(parent.func, ast.Attribute) else getattr(parent.func, "id", "")
    return name in ("to", "type") or "cast" in name.lower()


def _names(code: types.CodeType) -> Iterator[str]:
    # The attribute and global names a function's code (and the code nested in it: comprehensions, closures) uses.
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _self_path(node: ast.expr, aliases: Mapping[str, str] = types.MappingProxyType({})) -> str | None:
    # "a.b" for the expression self.a.b, "a.*" for self.a[k] (any layer held by the container self.a), the path of a
    # local name bound to one of those (aliases); else None.
    if isinstance(node, ast.Subscript):
        container = _self_path(node.value)
        return None if container is None or container.endswith("*") else f"{container}.*"
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    base = "" if node.id == "self" else aliases.get(node.id)
    if base is None or not (parts or base) or (parts and base.endswith("*")):
        return None
    return ".".join([base, *reversed(parts)] if base else reversed(parts))


def _aliases(tree: ast.AST) -> dict[str, str]:
    # Local names bound to a sub-layer of self (lora_A = self.lora_A[adapter]; proj = self.proj): their path. A name
    # bound twice to different paths is left out (which one a read meets is not known from the source).
    aliases: dict[str, str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, path = node.targets[0].id, _self_path(node.value)
            if path is not None:
                aliases[name] = path if aliases.get(name, path) == path else None
    return {name: path for name, path in aliases.items() if path is not None}
