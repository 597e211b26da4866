"""Which sub-layers' weights a module's own forward reads, from its source: code that computes with a linear layer's
weight itself (Mamba's ``self.dt_proj.weight @ x``) or casts a tensor to its dtype (T5's ``x.to(self.wo.weight.dtype)``)
bypasses an FP8 layer there, and at O2 would meet FP8AdamW's scaled fp16 master (lightning_fp8/eligibility.py)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
import weakref
from collections.abc import Callable, Iterator, Mapping

from torch import nn

# Attributes of a weight that use none of its values (its dtype does where a tensor is cast to it: "dtype_cast").
_WEIGHT_METADATA = frozenset(
    {"dtype", "device", "shape", "size", "ndim", "dim", "numel", "requires_grad", "requires_grad_", "is_meta", "grad"}
)


def forward_weight_reads(cls: type, forward: Callable | None = None, module: object = None) -> Mapping[str, str]:
    """The paths ``p`` for which the forward of ``cls`` (its ``forward`` and the methods of ``cls`` it names, as
    Mamba's calls ``self.cuda_kernels_forward``, and its bases' methods it calls through ``super()``) reads
    ``self.<p>.weight`` itself (directly or through a local name bound to ``self.<p>``, :func:`_aliases`; ``p`` is
    ``"<container>.*"`` for ``self.<container>[k].weight``, any layer the container holds, as PEFT's
    ``lora_A = self.lora_A[adapter]`` or a loop over ``self.layers``), read from the source: ``p`` ->
    ``"weight_read"`` where it computes with it (``self.dt_proj.weight @ x``), ``"dtype_cast"`` where it casts a tensor
    to its dtype (``x.to(self.wo.weight.dtype)``); other metadata (``.shape``, ``isinstance``) aside. Other methods (a
    LoRA layer's ``merge``, initialization) run outside the training step. Empty where the source cannot be read.

    ``forward``: an instance's own forward (``model.forward = ...``, which ``nn.Module.__call__`` runs) of ``module``,
    read as well (with what it calls): a method bound to ``module``, a ``functools.partial`` given ``module`` first, or
    a function reaching ``module`` through its closure or a global name. Each function's reading is cached (by the
    function object): a forward patched on the class later is read afresh."""
    found: dict[str, str] = {}
    for fn, self_names in _reached_methods(cls, _own_forward(forward, module)):
        for path, use in _function_reads(fn, self_names).items():
            if use == "weight_read" or path not in found:  # a read anywhere outweighs a cast elsewhere
                found[path] = use
    return types.MappingProxyType(found)


# Each function's reads, by the names standing for the module in it (weakly: functions defined and dropped in a loop).
_READS: weakref.WeakKeyDictionary[types.FunctionType, dict[frozenset[str], Mapping[str, str]]] = (
    weakref.WeakKeyDictionary()
)


def _function_reads(fn: types.FunctionType, self_names: frozenset[str]) -> Mapping[str, str]:
    by_names = _READS.setdefault(fn, {})
    if self_names not in by_names:
        by_names[self_names] = types.MappingProxyType(_read_function(fn, self_names))
    return by_names[self_names]


def _read_function(fn: types.FunctionType, self_names: frozenset[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    if "weight" not in _names(fn.__code__):
        return found
    try:
        tree = _AsSelf(self_names).visit(ast.parse(textwrap.dedent(inspect.getsource(fn))))
    except Exception:  # no source to read (a REPL, generated code): a best effort, never a failed conversion
        return found
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
    return found


class _AsSelf(ast.NodeTransformer):
    """Renames the names standing for the module to ``self`` (and a ``self`` that is something else away from it), so
    that the reading below knows one name for the module."""

    def __init__(self, self_names: frozenset[str]) -> None:
        self.self_names = self_names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.self_names:
            node.id = "self"
        elif node.id == "self":
            node.id = " not self"  # no identifier: matches no name
        return node


_SELF = frozenset({"self"})


def _own_forward(forward: Callable | None, module: object) -> tuple[types.FunctionType, frozenset[str]] | None:
    """The function of an instance's own ``forward`` and the names standing for ``module`` in it; None where it is
    none of the forms :func:`forward_weight_reads` reads."""
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        fn, first = forward.__func__, True
    elif isinstance(forward, functools.partial) and forward.args and forward.args[0] is module:
        fn, first = forward.func, True  # Accelerate's hooks: partial(new_forward, module)
    else:
        fn, first = forward, False
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    names = {code.co_varnames[0]} if first and code.co_argcount else set()
    cells = zip(code.co_freevars, fn.__closure__ or (), strict=True)
    names.update(name for name, cell in cells if _cell_value(cell) is module)
    names.update(name for name in code.co_names if fn.__globals__.get(name) is module)  # a script's global model
    return (fn, frozenset(names)) if names else None


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _reached_methods(
    cls: type, own: tuple[types.FunctionType, frozenset[str]] | None = None
) -> list[tuple[types.FunctionType, frozenset[str]]]:
    # The functions the forward of cls (and the instance's own forward, own) may call, with the names standing for the
    # module in each: the methods whose name their code uses, each resolved by the MRO as self.<name> is, and through
    # super() from the class defining the caller (a subclass's forward calling super().forward(x): its base's forward
    # too).
    mro = [klass for klass in cls.__mro__ if klass is not nn.Module and klass is not object]
    reached: dict[tuple[types.FunctionType, frozenset[str]], int] = {}  # -> the index in mro of its defining class
    todo = [_with_self(_method(mro, "forward", 0))]
    if own is not None:
        todo.append((own[0], len(mro), own[1]))  # no class of mro defines it: super() in it means nothing here
    while todo:
        found = todo.pop()
        if found is None or (found[0], found[2]) in reached:
            continue
        fn, index, names_of_self = found
        reached[fn, names_of_self] = index
        names = set(_names(fn.__code__))
        for name in names:
            todo.append(_with_self(_method(mro, name, 0)))
            if "super" in names and index < len(mro):
                todo.append(_with_self(_method(mro, name, index + 1)))
    return list(reached)


def _with_self(found: tuple[types.FunctionType, int] | None) -> tuple[types.FunctionType, int, frozenset[str]] | None:
    return None if found is None else (*found, _SELF)


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
