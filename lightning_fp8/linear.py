"""FP8Linear: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 with per-tensor scaling.

::

    forward   y  = x_fp8  @ w_fp8^T        E4M3 x E4M3, fp32 accumulate, out in the activation dtype
    dgrad     dx = dy_fp8 @ w_fp8          E5M2 x E4M3 (hybrid) or E4M3 x E4M3
    wgrad     dw = dy_fp8^T @ x_fp8        E5M2 x E4M3

``torch._scaled_mm`` wants its first operand row-major and its second column-major, so the casts also
write transposed FP8 copies (one read of the input, see kernels/cast.py). The backward keeps the FP8
copies, not the high-precision input: activation memory for linear inputs halves.

The autograd function and its GEMMs live in ``matmul.py`` (with the switches of what the forward keeps for the
backward); what FP8 training sets on the weight Parameter, and how it survives a new one, in ``weight_marks.py``.
"""

from __future__ import annotations

import copy
import numbers
import sys
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lightning_fp8 import ops, weight_cache
from lightning_fp8.autograd_rules import check_no_functorch
from lightning_fp8.linear_checks import _ACTIVATION_DTYPES, check_input, check_not_reparametrized
from lightning_fp8.matmul import _FP8Matmul, current_flags, note_casts

# Re-exported: mlp.py (forward_gemm, backward_gemms) and distributed/tensor_parallel_linear.py (grad_output_current)
# import these from here.
from lightning_fp8.matmul import backward_gemms as backward_gemms
from lightning_fp8.matmul import forward_gemm as forward_gemm
from lightning_fp8.matmul import grad_output_current as grad_output_current
from lightning_fp8.optim import master, master_layer
from lightning_fp8.recipe import FP8Recipe, check_flag, resolve_recipe
from lightning_fp8.recompute import forward_call
from lightning_fp8.scaling import ScalingState
from lightning_fp8.weight_marks import LayerMark, after_load, before_load, mark_weight, put_back_marks, weight_marks

# What every nn.Linear holds in its __dict__; FP8Linear.from_linear carries any other plain attribute over.
_LINEAR_ATTRS = frozenset(vars(nn.Linear(16, 16, device="meta")))


def tokens_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., features) as (tokens, features). The token count is given, not inferred: ``reshape(-1, 0)`` cannot
    infer it (any count of empty rows has 0 elements), and a layer with ``in_features=0`` works as ``nn.Linear``'s."""
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of an FP8 layer's output for input ``x``: autocast's where autocast is on, else ``x``'s."""
    return ops.autocast_dtype(x.device) or x.dtype


def _unparametrizing(layer: nn.Module) -> bool:
    """Whether torch is registering ``layer``'s weight as it undoes a reparametrization (the weight is then the layer's
    own, computed from the originals): ``parametrize.remove_parametrizations`` registers it while the layer still holds
    its ``parametrizations``, the legacy ``remove_weight_norm`` / ``remove_spectral_norm`` while their pre-hook is still
    there."""
    if "parametrizations" in layer._modules:
        return True
    return any(
        type(hook).__name__ in ("WeightNorm", "SpectralNorm") and getattr(hook, "name", None) == "weight"
        for hook in layer._forward_pre_hooks.values()
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    # Costs nothing without tensor parallelism: a DTensor exists only once torch.distributed.tensor is imported.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


class FP8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs; same parameters, state_dict keys and call (``layer(x)``, ``layer(input=x)``).

    The FP8 scaling state (scales, amax histories, statistics) lives in ``self.fp8_scaling``, a
    ``ModuleDict`` of :class:`~lightning_fp8.scaling.ScalingState` per role (``input``, ``weight``,
    ``grad_output``) with non-persistent buffers: save it with :func:`lightning_fp8.fp8_state_dict`.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``. Both feature sizes must be
            multiples of 16 (an FP8 GEMM requirement); ``bias`` must be True or False; ``dtype`` float32,
            bfloat16 or float16 (``None``: the default dtype, which must then be one of them).
        recipe: an :class:`~lightning_fp8.FP8Recipe` or recipe name (default ``"fp8-lm"``).

    The output dtype is the autocast dtype when autocast is on, else the input's dtype (bf16, fp16, fp32).

    The casts of each role use the tensor's own amax until one sees a finite amax > 0 (no history yet: an empty or
    all-zero tensor, or one with inf or NaN, carries no information; the output of a zero-initialized layer): the
    grad_output role decides so when its backward runs, so forwards without a backward before it (an evaluation pass,
    micro-batches before their one backward, a second use of the layer) do not use up its first cast. Eagerly only:
    under ``torch.compile`` the decision is taken when the forward is traced.

    The backward is differentiable once: a double backward through the layer (``create_graph=True``, a gradient
    penalty) raises when the second-order term is needed, rather than dropping it. ``torch.func`` transforms
    (``grad``, ``vmap``...) are not supported: the forward raises RuntimeError under them.

    Activation checkpointing (``torch.utils.checkpoint`` with ``use_reentrant=False``, which Lightning's and FSDP's
    activation checkpointing use): where one forward of the layer waits for its backward (per-block checkpoints, one
    backward per forward or micro-batch, nested checkpoints), the recompute casts with the scales that forward used
    and records no statistics: the gradients are bit for bit those of the run without checkpointing, also where the
    layer's forward in the region builds no graph (frozen, no_grad) or its output is unused (torch >= 2.8). Where
    several wait (micro-batch losses summed into one backward, pipeline orders, the layer twice in one region), a
    region's recompute repeats the region's forwards of the layer in order: bit for bit too (torch >= 2.8). Where no
    region tells them apart, it warns and casts with the recomputed input's own amax, recording nothing:
    FP8-accurate, not bit for bit (:mod:`lightning_fp8.recompute`). Selective activation checkpointing
    (``context_fn=create_selective_checkpoint_contexts(policy)``) gives the same gradients whatever the policy saves:
    the casts' bookkeeping is out of its sight. Reentrant checkpointing (``use_reentrant=True``, whose forward runs
    under no_grad and keeps nothing) takes the own-amax path, warning once. ``torch.compile`` does not trace a
    checkpointed region holding FP8 layers (their traced forwards have a Python side effect): it runs the region
    eagerly, with the rule above, also after a recompile (``fullgraph=True`` cannot cover such a region). Compile
    outside the checkpoint, not inside it (docs/concepts/gemms.md).

    Example:
        >>> layer = FP8Linear(64, 32)
        >>> layer(torch.randn(4, 10, 64)).shape
        torch.Size([4, 10, 32])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: FP8Recipe | str | None = None,
    ) -> None:
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(size, bool) or not isinstance(size, numbers.Integral):
                raise TypeError(f"FP8Linear({name}={size!r}): must be an int (a multiple of 16)")
            if size < 0:  # -16 is a multiple of 16: else torch's "negative dimension" RuntimeError from the weight
                raise ValueError(f"FP8Linear({name}={size}): a feature size must be >= 0 (a multiple of 16)")
            if size % 16:
                raise ValueError(
                    f"FP8Linear({name}={size}): FP8 GEMMs need feature sizes that are multiples of 16; "
                    "keep this layer as nn.Linear (convert_to_fp8 does so automatically)"
                )
        check_flag("FP8Linear", "bias", bias)  # nn.Linear takes its truth value: bias="False" would make one
        if dtype is not None and not isinstance(dtype, torch.dtype):  # else "keep a float32 layer" for "float32"
            raise TypeError(
                f"FP8Linear(dtype={dtype!r}): must be a torch.dtype (torch.float32, torch.bfloat16 or torch.float16), "
                f"got {type(dtype).__name__}"
            )
        if dtype is not None and dtype not in _ACTIVATION_DTYPES:  # as the first forward would refuse it, but now
            raise TypeError(
                f"FP8Linear(dtype={dtype}): FP8 layers keep float32, bfloat16 or float16 parameters; keep a "
                f"{dtype} layer as nn.Linear (convert_to_fp8 leaves such layers as they are)"
            )
        if dtype is None and torch.get_default_dtype() not in _ACTIVATION_DTYPES:  # nn.Linear takes the default's
            raise TypeError(
                f"FP8Linear(dtype=None) would keep {torch.get_default_dtype()} parameters, the default dtype "
                "(torch.set_default_dtype), which FP8 layers do not take: pass dtype=torch.float32 (or bfloat16, "
                "float16), or build the layer with the default dtype set back (torch.set_default_dtype(torch.float32))"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._recipe = resolve_recipe(recipe, "FP8Linear(recipe=...)")
        self._init_scaling(self.weight.device)

    @property
    def recipe(self) -> FP8Recipe:
        """The recipe the layer was built or converted with; read-only: its scaling states were built from it."""
        return self._recipe

    @recipe.setter
    def recipe(self, value: Any) -> None:
        # The casts read the scaling states (format, delayed or current, margin, history), not this attribute: a new
        # value would change the repr and convert_to_fp8's recipe check but not one cast.
        raise AttributeError(
            f"FP8Linear.recipe cannot be set (got {value!r}): the layer's scaling states were built from the recipe "
            f"it was converted with ({self._recipe}), and the casts would keep using them. Convert a fresh nn.Linear "
            "(FP8Linear.from_linear or convert_to_fp8 with the new recipe) or build a new FP8Linear(..., recipe=...)"
        )

    def _init_scaling(self, device: torch.device) -> None:
        r = self.recipe
        delayed = r.scaling == "delayed"
        common = {"margin": r.margin, "algo": r.amax_compute_algo, "device": device}
        # FP8AdamW (O2) recognises the weight by this marker and may keep its fp16 master in the weight's storage,
        # scaled: the hooks export and import the unscaled weight (lightning_fp8/optim/master.py).
        mark_weight(self)
        self.register_state_dict_post_hook(master_layer.state_dict_hook)
        self.register_load_state_dict_pre_hook(master_layer.load_state_dict_pre_hook)
        self.register_load_state_dict_pre_hook(before_load)
        self.register_load_state_dict_post_hook(after_load)
        self.fp8_scaling = nn.ModuleDict(
            {
                "input": ScalingState(r.forward_dtype, r.amax_history_len, delayed=delayed, **common),
                # Weights know their amax exactly (the optimizer just wrote them): always current scaling.
                "weight": ScalingState(r.forward_dtype, 1, delayed=False, **common),
                "grad_output": ScalingState(r.backward_dtype, r.amax_history_len, delayed=delayed, **common),
            }
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | str | None = None) -> FP8Linear:
        """Wrap an existing ``nn.Linear``, sharing its parameter objects (optimizers that hold them keep working) and
        its forward and backward hooks (:func:`lightning_fp8.convert.share_hooks`: their handles keep working).
        It cannot see other modules: a weight tied to another module's (an embedding's) is not refused here, as
        :func:`~lightning_fp8.convert_to_fp8` of the whole model would; at O2 FP8AdamW would then keep its fp16 master
        in the storage the other module reads.

        Raises:
            TypeError: if ``linear`` is not an ``nn.Linear``, or its weight is not float32, bfloat16 or float16.
            TypeError: called on a subclass of FP8Linear that defines its own ``__init__`` but not its own
                ``from_linear``: this constructor would skip that ``__init__`` (buffers or attributes it sets would be
                missing). Build the subclass itself and load the linear's weights, or override ``from_linear``
                (``super().from_linear(...)``, then what the ``__init__`` adds).
            ValueError: for an FP8Linear (already one: use it as it is), for a layer that
                :func:`~lightning_fp8.convert_to_fp8` leaves in high precision for what it is (a reparametrized weight,
                a subclass of ``nn.Linear``, a weight or bias that is not a parameter, parameters, buffers or
                submodules besides weight and bias, state_dict hooks, an instance ``forward`` or a compiled call
                (``layer.compile()``): the FP8 layer would drop them), or feature sizes that are not multiples of 16.
        """
        from lightning_fp8 import convert, eligibility  # here: they import this module

        if cls.__init__ is not FP8Linear.__init__ and cls.from_linear.__func__ is FP8Linear.from_linear.__func__:
            raise TypeError(
                f"{cls.__name__}.from_linear builds the layer without calling {cls.__name__}.__init__, which "
                f"{cls.__name__} defines (what it registers would be missing): construct {cls.__name__}(...) and load "
                "the linear's state_dict into it, or override from_linear (super().from_linear(...), then set up "
                "what __init__ adds)"
            )
        eligibility.check_wrappable(linear, "FP8Linear.from_linear")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = eligibility.weight_features(linear)  # what the nn.Linear computed with
        if new.in_features % 16 or new.out_features % 16:
            raise ValueError(f"FP8Linear.from_linear({linear}): FP8 GEMMs need feature sizes that are multiples of 16")
        new.register_parameter("weight", linear.weight)
        new.register_parameter("bias", linear.bias)  # registered when None too, as nn.Linear(bias=False) does
        new._recipe = resolve_recipe(recipe, "FP8Linear.from_linear(recipe=...)")
        new._init_scaling(linear.weight.device)
        new.train(linear.training)  # after the scaling states exist: they take the layer's mode too
        convert.share_hooks(linear, new)
        for name, value in vars(linear).items():  # the user's own plain attributes (a tag, a flag read elsewhere)
            if name not in _LINEAR_ATTRS and name not in vars(new):
                new.__dict__[name] = value
        master.note_conversion()  # an FP8AdamW built before over this weight refuses to step it (one int per step)
        return new

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of weight and bias, and a fresh scaling state (:meth:`ScalingState.reset`):
        meta-device materialization (``to_empty()`` then ``reset_parameters()``, as Lightning and FSDP do) must not
        leave the scaling buffers uninitialized memory, and new weights make the old statistics meaningless.

        A weight whose storage FP8AdamW (O2) holds as its scaled master is initialized in fp32 (the same random draws
        as an fp32 layer) and stored scaled, with a fresh master scale, as a loaded weight is."""
        weight = self._parameters.get("weight")
        if weight is not None and master.master_scale(weight) is not None:
            init = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            nn.Linear.reset_parameters(SimpleNamespace(weight=init, bias=self.bias))  # nn.Linear's init, into init
            incoming = {"weight": init}
            # scales init, renews the master scale and amax
            master_layer.load_state_dict_pre_hook(self, incoming, "", {})
            with torch.no_grad():
                weight.copy_(incoming["weight"])  # through the parameter: its FP8 copy is invalid from now on
        else:
            super().reset_parameters()
        scaling = self._modules.get("fp8_scaling")  # nn.Linear.__init__ calls this before _init_scaling
        if scaling is not None:
            for state in scaling.values():
                state.reset()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        if name != "weight":  # pruning's weight_orig, weight_norm's weight_g, taking an O2 master
            master_layer.check_kept_weight(self, name, param)
        # Undoing a reparametrization, torch registers the weight where none is registered (it was the
        # reparametrization's); an assignment replacing a registered weight may be a tie (below).
        undoing = name == "weight" and self._parameters.get("weight") is None and _unparametrizing(self)
        super().register_parameter(name, param)
        if name == "weight":  # the master scale torch.export reads (master.LAYER_SCALE_ATTR): the new weight's
            master.track_layer_scale(self, param)
        # torch's own parallel styles (ColwiseParallel's distribute_module) register the layer's weight again as a
        # DTensor, and removing weight norm registers a new Parameter holding the computed weight: without the mark an
        # FP8AdamW would train either as a plain parameter (fp32 states, no O2 master). Only those: a plain Parameter
        # assigned here may be another module's (weights tied after conversion, e.g. Hugging Face's tie_weights()),
        # whose storage an O2 master must not take (convert_to_fp8 leaves tied layers in high precision for that
        # reason).
        if name == "weight" and "fp8_scaling" in self._modules and (_is_dtensor(param) or undoing):
            mark_weight(self)

    def __delattr__(self, name: str) -> None:
        if name == "weight":  # parametrize and spectral_norm delete it first: refused for an O2 master
            master_layer.check_kept_weight(self, name)
        super().__delattr__(name)

    def _apply(self, fn, recurse: bool = True):
        # to_empty() from the meta device gives the weight a new Parameter object, swap_module_params_on_conversion
        # new contents: keep what FP8 training set on it (see lightning_fp8/weight_marks.py).
        marks = weight_marks(self)
        super()._apply(fn, recurse)
        put_back_marks(self, marks)
        return self

    def __deepcopy__(self, memo: dict) -> FP8Linear:
        """A deep copy (``copy.deepcopy``) whose weight keeps what FP8 training set on it, which ``nn.Parameter``'s
        deep copy drops: the FP8-weight marker (an FP8AdamW given the copy gives it FP8 states) and, at O2, the master
        scale its storage holds the weight times (the copy's forward and ``state_dict()`` see the true weight). The
        optimizer's FP8 copy of the weight is not copied.

        ``torch.optim.swa_utils.AveragedModel`` deep-copies the model this way, but then averages the parameters'
        storage, which at O2 is FP8AdamW's scaled fp16 master (``weight * master_scale``, the scale moving from step
        to step): the average is wrong. Average the unscaled weights of ``model.state_dict()`` instead, or train at
        O1, where the storage is the weight (docs/guides/checkpoints.md)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        for attr in (master.MARKER, master.SCALE_ATTR, master.AMAX_ATTR, master.DTYPE_ATTR):
            if hasattr(self.weight, attr):
                setattr(new.weight, attr, copy.deepcopy(getattr(self.weight, attr), memo))
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "recipe" in state:  # pickled before ``recipe`` became a read-only property over ``_recipe``
            state["_recipe"] = state.pop("recipe")
        super().__setstate__(state)
        if isinstance(getattr(self._parameters.get("weight"), master.MARKER, None), (LayerMark, set)):
            mark_weight(self)  # unpickled (torch.load of a pickled model): the mark came back as an empty set

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, fp8_format={r.fp8_format}, scaling={r.scaling}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Named as nn.Linear.forward's argument: layer(input=x) and functional_call(..., kwargs={"input": x}) are
        # nn.Linear call forms too.
        x = input
        check_not_reparametrized(self)
        check_no_functorch("FP8Linear")
        weight = self.weight  # a Module.__getattr__ each time: read once (this runs for every layer and step)
        if _is_dtensor(weight):  # tensor parallel: FP8 GEMMs on the local shards
            from lightning_fp8.distributed.tensor_parallel_linear import dtensor_forward

            return dtensor_forward(self, x)
        check_input(self, x, weight)
        out_dtype = output_dtype(x)
        flat = x.dim() == 2  # already (tokens, in_features): no reshapes (each is an op and a backward node)
        x_2d = x if flat else tokens_2d(x)
        scaling = self.fp8_scaling
        master_scale = master.forward_master_scale(weight, "FP8Linear", self)
        key = weight_cache.compiled_key(weight, scaling["weight"])
        call = forward_call(scaling["input"])
        y = _FP8Matmul.apply(
            x_2d, weight, self.bias, scaling, out_dtype, current_flags(scaling), master_scale, key, call,
            torch.is_grad_enabled(),
        )  # fmt: skip
        note_casts(scaling, x_2d, y)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)
