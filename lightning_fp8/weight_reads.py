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
    Mamba's calls ``self.cuda_kernels_forward``, and its bases' methods it calls through ``super()``) reads
    ``self.<p>.weight`` itself (directly or through a local name bound to ``self.<p>``, :func:`_aliases`; ``p`` is
    ``"<container>.*"`` for ``self.<container>[k].weight``, any layer the container holds, as PEFT's
    ``lora_A = self.lora_A[adapter]`` or a loop over ``self.layers``), read from the source: ``p`` ->
    ``"weight_read"`` where it computes with it (``self.dt_proj.weight @ x``), ``"dtype_cast"`` where it casts a tensor
    to its dtype (``x.to(self.wo.weight.dtype)``); other metadata (``.shape``, ``isinstance``) aside. Other methods (a
    LoRA layer's ``merge``, initialization) run outside the training step. Empty where the source cannot be read."""
    found: dict[str, str] = {}
    for fn in _reached_methods(cls):
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


def _reached_methods(cls: type) -> list[types.FunctionType]:
    # The functions the forward of cls may call: the methods whose name its code (or theirs) uses, each resolved by
    # the MRO as self.<name> is, and through super() from the class defining the caller (a subclass's forward calling
    # super().forward(x): its base's forward too).
    mro = [klass for klass in cls.__mro__ if klass is not nn.Module and klass is not object]
    reached: dict[types.FunctionType, int] = {}  # function -> the index in mro of the class defining it
    todo = [_method(mro, "forward", 0)]
    while todo:
        found = todo.pop()
        if found is None or found[0] in reached:
            continue
        fn, index = found
        reached[fn] = index
        names = set(_names(fn.__code__))
        for name in names:
            todo.append(_method(mro, name, 0))
            if "super" in names:
                todo.append(_method(mro, name, index + 1))
    return list(reached)


def _method(mro: list[type], name: str, start: int) -> tuple[types.FunctionType, int] | None:
    # The function that attribute lookup finds for name from mro[start] on (unwrapped: functools.wraps decorators), and
    # the index of its class; None for a name no class there defines, or defines as something other than a function.
    for index in range(start, len(mro)):
        if name in vars(mro[index]):
            attr = vars(mro[index])[name]
            fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            try:
                fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else None
            except ValueError:  # a __wrapped__ cycle
                return None
            return (fn, index) if isinstance(fn, types.FunctionType) else None
    return None


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
    # Local names bound to a sub-layer of self (lora_A = self.lora_A[adapter]; proj = self.proj; proj: nn.Linear =
    # self.proj; proj, scale = self.proj, 1.0; (proj := self.proj)) or to each layer a container holds (for layer in
    # self.layers, in a loop or a comprehension; enumerate(self.layers), self.experts.values()): their path. A name
    # bound twice to different paths is left out (which one a read meets is not known from the source).
    aliases: dict[str, str | None] = {}
    for target, path in _bindings(tree):
        if isinstance(target, ast.Name) and path is not None:
            aliases[target.id] = path if aliases.get(target.id, path) == path else None
    return {name: path for name, path in aliases.items() if path is not None}


def _bindings(tree: ast.AST) -> Iterator[tuple[ast.expr, str | None]]:
    # (target, path of the value bound to it) for the assignments and loop targets of tree; tuples pair up.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            yield from _pairs(node.targets[0], node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            yield from _pairs(node.target, node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield from _loop_pairs(node.target, node.iter)


def _pairs(target: ast.expr, value: ast.expr) -> Iterator[tuple[ast.expr, str | None]]:
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
        if len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                yield from _pairs(t, v)
        return
    yield target, _self_path(value)


def _loop_pairs(target: ast.expr, iterable: ast.expr) -> Iterator[tuple[ast.expr, str | None]]:
    # for layer in self.layers / self.layers[1:] / self.layers.values() / reversed(self.layers); for i, layer in
    # enumerate(...); for name, layer in self.layers.items().
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    if isinstance(iterable, ast.Call) and not iterable.keywords and len(iterable.args) == 1:
        name = getattr(iterable.func, "id", None)
        if name == "enumerate" and pair:
            yield from _loop_pairs(target.elts[1], iterable.args[0])
            return
        if name == "reversed":
            yield from _loop_pairs(target, iterable.args[0])
            return
    if isinstance(iterable, ast.Call) and not iterable.args and isinstance(iterable.func, ast.Attribute):
        if iterable.func.attr == "items" and pair:
            yield from _loop_pairs(target.elts[1], iterable.func.value)
            return
        if iterable.func.attr in ("values", "children"):
            iterable = iterable.func.value
    if isinstance(iterable, ast.Subscript) and isinstance(iterable.slice, ast.Slice):  # a slice of a ModuleList
        iterable = iterable.value
    container = _self_path(iterable)
    yield target, None if container is None or container.endswith("*") else f"{container}.*"
