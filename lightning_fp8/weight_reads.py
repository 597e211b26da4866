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
                paths, parent = _self_paths(node.value, aliases), parents.get(node)
                if _is_type_check(parent):
                    continue
                attr = parent.attr if isinstance(parent, ast.Attribute) else None
                cast = attr == "dtype" and _is_cast_argument(parent, parents)
                for path in paths:  # a local name bound to several layers: each may be the one read
                    if cast:
                        found.setdefault(path, "dtype_cast")
                    elif attr not in _WEIGHT_METADATA:
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


def _self_path(node: ast.expr) -> str | None:
    # "a.b" for the expression self.a.b, "a.*" for self.a[k] (any layer held by the container self.a); else None.
    paths = _self_paths(node)
    return paths[0] if paths else None


def _self_paths(node: ast.expr, aliases: Mapping[str, tuple[str, ...]] = types.MappingProxyType({})) -> list[str]:
    # The paths _self_path gives, or those of a local name bound to sub-layers of self (aliases: every path it is bound
    # to somewhere in the function, as a read may meet any of them).
    if isinstance(node, ast.Subscript):
        return [f"{c}.*" for c in _self_paths(node.value) if not c.endswith("*")]
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    bases = ("",) if node.id == "self" else aliases.get(node.id, ())
    return [".".join([base, *reversed(parts)] if base else reversed(parts))
            for base in bases if (parts or base) and not (parts and base.endswith("*"))]  # fmt: skip


def _aliases(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    # Local names bound to a sub-layer of self (lora_A = self.lora_A[adapter]; proj = self.proj; proj: nn.Linear =
    # self.proj; proj, scale = self.proj, 1.0; (proj := self.proj)) or to each layer a container holds (for layer in
    # self.layers, in a loop or a comprehension; enumerate(self.layers), self.experts.values()): every path each is
    # bound to (which one a read meets is not known from the source).
    aliases: dict[str, tuple[str, ...]] = {}
    for target, path in _bindings(tree):
        if isinstance(target, ast.Name) and path is not None and path not in aliases.get(target.id, ()):
            aliases[target.id] = (*aliases.get(target.id, ()), path)
    return aliases


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
        starred = [i for i, t in enumerate(target.elts) if isinstance(t, ast.Starred)]
        head = starred[0] if starred else len(target.elts)  # a, *rest = ...: the names before and after the star
        tail = len(target.elts) - head - 1 if starred else 0
        if len(value.elts) == len(target.elts) or (starred and len(value.elts) >= head + tail):
            for t, v in zip(target.elts[:head], value.elts[:head], strict=True):
                yield from _pairs(t, v)
            ends = zip(target.elts[len(target.elts) - tail :], value.elts[len(value.elts) - tail :], strict=True)
            for t, v in ends if tail else ():
                yield from _pairs(t, v)
        return
    yield target, _self_path(value)


def _loop_pairs(target: ast.expr, iterable: ast.expr) -> Iterator[tuple[ast.expr, str | None]]:
    # for layer in self.layers / self.layers[1:] / self.layers.values() / reversed(self.layers); for i, layer in
    # enumerate(...); for name, layer in self.layers.items().
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    if isinstance(iterable, ast.Call) and iterable.args:
        name = getattr(iterable.func, "id", None)
        if name == "enumerate" and pair:  # enumerate(self.layers, 1), enumerate(..., start=1) too
            yield from _loop_pairs(target.elts[1], iterable.args[0])
            return
        if name == "reversed" and len(iterable.args) == 1 and not iterable.keywords:
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
