"""The per-step functions every built-in shares: place, forward, backward, update.

A built-in substitutes only what differs (``ddp`` wraps the module, for
example); these are the plain-PyTorch meaning of each field.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import weakref
from typing import Any

import torch

from stratagem.env import Context, check_context
from stratagem.errors import UsageError, describe
from stratagem.fields import ForwardFn
from stratagem.optimizer_hooks import OptimizerHook, root_optimizer
from stratagem.parts import part_of
from stratagem.trees import map_tensors
from stratagem.validators import is_number, refusal, require

__all__ = [
    "OPTIMIZER_NOT_FOR_MODULE",
    "STEP_WITHOUT_FORWARD",
    "TRUSTED_PAIR",
    "UNWRAPPED_UNDER_DDP",
    "backward",
    "check_loss",
    "check_module",
    "check_not_inside",
    "check_optimizer",
    "check_optimizer_holds",
    "check_update",
    "is_trusted",
    "mark_inside_a_wrapper",
    "move_batch",
    "move_to_device",
    "no_sync",
    "step",
    "to_device",
    "update",
]


def check_module(module: object, function: str) -> torch.nn.Module:
    """Return ``module`` if it is a ``torch.nn.Module``.

    Raises:
        UsageError: it is not (arguments in the wrong order, an optimizer, ...).
    """
    if not isinstance(module, torch.nn.Module):
        hint = "; pass the module that wrap returned"
        raise refusal(f"{function}: 'module'", "a torch.nn.Module", module, hint=hint)
    return module


def check_loss(loss: object, function: str) -> torch.Tensor:
    """Return ``loss`` if it is a one-element tensor that requires grad.

    Raises:
        UsageError: it is not; the message says why and how to fix it.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shown = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else describe(loss)
        )
        raise UsageError(
            f"{function}: 'loss' must be a one-element tensor (got {shown}); reduce it first, "
            "e.g. loss.mean()."
        )
    if not loss.requires_grad:
        raise UsageError(
            f"{function}: 'loss' does not require grad: it was computed without the module's "
            "parameters (does the module have any?), under torch.no_grad(), or after .detach()."
        )
    return loss


def check_optimizer(optimizer: object, function: str) -> None:
    """Check that ``optimizer`` can step: a ``torch.optim.Optimizer``, or anything shaped like one.

    Raises:
        UsageError: it lacks ``step``, ``zero_grad`` or ``param_groups``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return  # the common case in one test: its __init__ sets param_groups
    ok = (
        callable(getattr(optimizer, "step", None))
        and callable(getattr(optimizer, "zero_grad", None))
        and hasattr(optimizer, "param_groups")
    )
    hint = "; the arguments are (optimizer, module, ctx)"
    require(ok, f"{function}: 'optimizer'", "a torch.optim.Optimizer", optimizer, hint=hint)


OPTIMIZER_NOT_FOR_MODULE = (
    "{function}: the optimizer holds none of the parameters of the {module} passed with it "
    "({count} parameter(s)), so stepping it would not train that module; build the optimizer "
    "from the module that wrap returned, after wrap (fsdp and tensor_parallel replace the "
    "parameters), e.g. torch.optim.AdamW(model.parameters())."
)

# optimizer -> the modules it was found to hold parameters of: the check walks every parameter
# once per pair, and a step then costs one lookup. Weak on both sides: nothing is kept alive.
_HOLDS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


_NO_ONE = object()  # what an empty slot names: never an argument, unlike None


def _dead() -> object:
    return _NO_ONE


def _forget(_: object) -> None:
    TRUSTED_PAIR[:] = [_dead, _dead]  # a dead reference returns None, which a caller may pass


# Weak references of the last (optimizer, module) pair that passed `check_update`: the usual
# loop's pair, trusted from then on. An update layer tests it as `is_trusted` does, inline where
# a call would cost a step (`update`, allreduce_grads'), and checks only if it is not the pair.
TRUSTED_PAIR: list[Any] = [_dead, _dead]


def check_optimizer_holds(optimizer: Any, module: object, function: str) -> None:
    """Check that ``optimizer`` holds at least one parameter of ``module``.

    A subset is fine (a frozen part, param groups), and so are parameters
    beyond the module's (a learnable loss term); none at all is the mark of an
    optimizer built over another module, or over this one before ``wrap``
    replaced its parameters. The verdict is kept per (optimizer, module) pair.

    Raises:
        UsageError: ``optimizer`` holds none of ``module``'s parameters
            (`OPTIMIZER_NOT_FOR_MODULE`).
    """
    if isinstance(optimizer, OptimizerHook):  # a combinator's view, made anew for every update
        optimizer = root_optimizer(optimizer)
    last_optimizer, last_module = TRUSTED_PAIR
    if last_optimizer() is optimizer and last_module() is module:
        return  # the usual loop: one pair, two dereferences
    try:
        known = _HOLDS.get(optimizer)
    except TypeError:  # an optimizer-like object without weak references: checked every time
        known = None
    if known is not None and module in known:
        return
    if not isinstance(module, torch.nn.Module):
        return  # the field's own check names it
    ours = {id(p) for p in module.parameters()}
    held = (id(p) for group in optimizer.param_groups for p in group["params"])
    if ours and not any(p in ours for p in held):
        raise UsageError(
            OPTIMIZER_NOT_FOR_MODULE.format(
                function=function, module=type(module).__name__, count=len(ours)
            )
        )
    with contextlib.suppress(TypeError):
        if known is None:
            known = _HOLDS.setdefault(optimizer, weakref.WeakSet())
        known.add(module)


def check_update(optimizer: Any, module: object, ctx: object, function: str = "update") -> None:
    """Check an update's arguments once per (optimizer, module) pair; then trust them.

    Every layer of an update calls this first, so the checks run where the
    arguments enter and cost two dereferences per step once the loop's pair
    is known. An `OptimizerHook` (a layer's view, new every step) is never
    trusted: a layer under one checks it in full.

    Raises:
        UsageError: ``optimizer`` cannot step, ``ctx`` is not a `Context`,
            ``optimizer`` holds none of ``module``'s parameters
            (`OPTIMIZER_NOT_FOR_MODULE`), or ``module`` is one that ``ddp()``'s
            wrap put inside its wrapper (`UNWRAPPED_UNDER_DDP`).
    """
    last_optimizer, last_module = TRUSTED_PAIR
    if last_optimizer() is optimizer and last_module() is module and ctx.__class__ is Context:
        return
    check_optimizer(optimizer, function)
    check_context(ctx, function)
    check_not_inside(module, function)
    check_optimizer_holds(optimizer, module, function)
    # A hook is made anew for every update; a module that is none is checked every time by the
    # layers that need one.
    if not isinstance(optimizer, OptimizerHook) and isinstance(module, torch.nn.Module):
        with contextlib.suppress(TypeError):  # no weak references: checked every time
            TRUSTED_PAIR[:] = [weakref.ref(optimizer, _forget), weakref.ref(module, _forget)]


def is_trusted(optimizer: Any, module: object, ctx: object) -> bool:
    """Whether ``check_update`` passed this (optimizer, module) pair, and ``ctx`` is a `Context`.

    An update layer with checks of its own (fsdp's, allreduce's) makes them, and
    `check_update`, only while this is false: checked once, then trusted.
    """
    last_optimizer, last_module = TRUSTED_PAIR
    return last_optimizer() is optimizer and last_module() is module and ctx.__class__ is Context


UNWRAPPED_UNDER_DDP = (
    "{function}: 'module' is the {module} from before wrap, not the DistributedDataParallel that "
    "wrap returned, so its gradients would not be averaged and the ranks would drift apart; pass "
    "the module that wrap returned (model = strategy.wrap(model, ctx)) and keep no other."
)

# id -> weak reference of each module that ddp()'s wrap put inside a DistributedDataParallel:
# kept by the user from before wrap, a step on one would synchronise nothing. By id, checked by
# identity, removed when the module dies: a step pays a dict lookup (a WeakSet's made a weakref
# every time, 0.6 µs).
_INSIDE: dict[int, weakref.ref[torch.nn.Module]] = {}


def mark_inside_a_wrapper(module: torch.nn.Module) -> None:
    """Record that ``module`` now lives inside a synchronising wrapper (``ddp()``'s wrap)."""
    key = id(module)

    def forget(_: weakref.ref[torch.nn.Module]) -> None:
        _INSIDE.pop(key, None)

    _INSIDE[key] = weakref.ref(module, forget)
    TRUSTED_PAIR[:] = [_dead, _dead]  # a pair known before may now name the module inside


def check_not_inside(module: object, function: str) -> None:
    """Raise if ``module`` is one that ``ddp()``'s wrap put inside its wrapper.

    Raises:
        UsageError: it is (`UNWRAPPED_UNDER_DDP`).
    """
    if _INSIDE:  # a program that never wrapped with DDP pays a truth test only
        known = _INSIDE.get(id(module))
        if known is not None and known() is module:
            raise UsageError(
                UNWRAPPED_UNDER_DDP.format(function=function, module=type(module).__name__)
            )


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Only the meta case is the caller's mistake; other failures (out of memory, a
    # device error) pass through unchanged, so that code catching them still can.
    if tensor.is_meta and device.type != "meta":
        raise UsageError(
            f"a tensor of the batch (shape {tuple(tensor.shape)}, on {tensor.device}) cannot "
            f"be moved to device {device}: a meta tensor holds no data; build the batch from "
            "real data, on the CPU or on that device."
        )
    return tensor.to(device, non_blocking=True)


_MODULE, _TENSOR = torch.nn.Module, torch.Tensor


def move_batch(batch: Any, device: torch.device) -> Any:
    """`move_to_device` for a ``device`` known to be a ``torch.device`` (a context's): no check."""
    # A plain tensor first, without a walk (`step` tests an (inputs, targets) tuple itself).
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else _moved(batch, device)
    return map_tensors(lambda t: t if t.device == device else _moved(t, device), batch)


def move_to_device(batch: Any, device: torch.device | str) -> Any:
    """Return ``batch`` with every tensor inside it moved to ``device``.

    Looks inside tuples (named ones too), lists, mappings and dataclass
    instances, as `stratagem.trees.map_tensors` does; anything else is returned
    as it is. A tensor already on ``device`` is not copied.

    Raises:
        UsageError: ``device`` is not a device, or a tensor cannot be moved
            there (a ``meta`` tensor holds no data to move).
    """
    wanted = device
    if isinstance(device, str):
        with contextlib.suppress(RuntimeError):  # not a device name: refused just below
            wanted = torch.device(device)
    if not isinstance(wanted, torch.device):
        what = "a torch.device or a device string such as 'cpu'"
        raise refusal("move_to_device: 'device'", what, device)
    return move_batch(batch, wanted)


def to_device(module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
    """Move ``module`` to ``ctx.device`` (the ``wrap`` of a single device).

    A module already there is returned as it is, and so is a module wholly on
    the meta device: it is initialised after wrapping (``to_empty``), as
    `fsdp` allows and `stratagem.planning.dry_run` does.

    Raises:
        UsageError: ``module`` is not a ``torch.nn.Module``, or ``ctx`` not a `Context`.
    """
    require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
    check_context(ctx, "wrap")
    devices = {t.device for t in itertools.chain(module.parameters(), module.buffers())}
    if devices == {ctx.device} or devices == {torch.device("meta")}:
        return module
    return module.to(ctx.device)


STEP_WITHOUT_FORWARD = (
    "step: without forward=, the module is called with the whole batch ({batch}), and it "
    "refused it ({error}). Pass the loss as forward=, e.g. step(model, batch, ctx, "
    "forward=lambda model, batch: loss_fn(model(batch[0]), batch[1]))."
)


def step(
    module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
) -> Any:
    """Move ``batch`` to the device and run ``forward(module, batch)`` (default ``module(batch)``).

    Put loss logic in ``forward`` rather than substituting ``step``: a
    combinator's forward context (autocast, ...) wraps this function.

    Raises:
        UsageError: ``module`` is not a module, ``forward`` not callable, ``ctx``
            not a `Context`, a tensor of the batch cannot be moved to the device, or
            ``module`` is one that ``ddp()``'s wrap put inside its wrapper
            (`UNWRAPPED_UNDER_DDP`).
    """
    # Every step runs this. In a loop whose code and data are cold after each torch step, what
    # costs is how many objects a step touches, so the usual case is one test, the batch walk
    # inline, and module-level names (`_MODULE`, `_TENSOR`): the checks and messages after.
    ok = forward is None or callable(forward)
    if not (isinstance(module, _MODULE) and ctx.__class__ is Context and ok):
        check_module(module, "step")
        check_context(ctx, "step")
        require(ok, "step: 'forward'", "None or a function forward(module, batch)", forward)
    if _INSIDE and torch.is_grad_enabled():  # evaluation under no_grad through it is fine
        check_not_inside(module, "step")
    device = ctx.device
    if type(batch) is tuple:  # the usual (inputs, targets), already there: kept as it is
        for part in batch:
            if type(part) is not _TENSOR or part.device != device:
                batch = move_batch(batch, device)
                break
    else:
        batch = move_batch(batch, device)
    if forward is not None:
        return forward(module, batch)
    try:
        return module(batch)
    except TypeError as error:
        if not isinstance(batch, (tuple, list, dict)):
            raise
        shown = f"a {type(batch).__name__} of {len(batch)}"
        raise UsageError(STEP_WITHOUT_FORWARD.format(batch=shown, error=error)) from error


def backward(loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
    """Backpropagate a scalar ``loss``.

    Raises:
        UsageError: ``loss`` is not a one-element tensor that requires grad, or
            ``ctx`` is not a `Context`.
    """
    if ctx.__class__ is not Context or loss.__class__ is not _TENSOR:  # torch takes a tuple
        check_context(ctx, "backward")
        check_loss(loss, "backward")
    # torch refuses a tensor that is not one element requiring grad before any backward runs,
    # so the usual step pays for no test of its own: the check and its message come after.
    try:
        torch.autograd.backward(loss)
        return
    except RuntimeError:
        if loss.numel() == 1 and loss.requires_grad:
            raise  # a failure inside a valid loss's backward: torch's own error, unchanged
    check_loss(loss, "backward")  # raises, saying what is wrong with the loss and how to fix it


def update(optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context) -> None:
    """Step ``optimizer``, then set the gradients to ``None``.

    Raises:
        UsageError: as `check_update`.
    """
    last_optimizer, last_module = TRUSTED_PAIR  # the trusted pair, tested here: a call saved a step
    if not (last_optimizer() is optimizer and last_module() is module and ctx.__class__ is Context):
        check_update(optimizer, module, ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_sync(module: torch.nn.Module, ctx: Context) -> contextlib.AbstractContextManager[None]:
    """Return a context that does nothing: one process has no gradients to synchronise.

    Raises:
        UsageError: ``module`` is not a module, or ``ctx`` not a `Context` (as on N ranks).
    """
    check_module(module, "no_sync")
    check_context(ctx, "no_sync")
    return contextlib.nullcontext()


_PLAIN = {torch.Tensor}  # gradients of these types are no DTensor: torch's norm, as it is


def clip_norm_(
    parameters: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    split_over: Any | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` to a total norm of at most ``max_norm``.

    The one norm clipper: `with_clipping` and `clip_grad_norm` both call it.
    On sharded (DTensor) gradients the norm is the global one, over every shard.

    Args:
        parameters: the parameters whose gradients to clip.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm.
        split_over: for a module split over ranks (a pipeline's stages), the
            process group of its parts: the norm is then the whole module's.

    Returns:
        The total norm before clipping, a plain tensor, the same on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if split_over is None and set(map(type, grads)) <= _PLAIN:
        # No DTensor, one module: the two halves of torch's clip_grad_norm_, on the gradients
        # found once (the same operations, so the same bits as clip_grad_norm_ by hand).
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm
    # By mesh equality, not identity: torch hands out equal meshes as distinct objects (a spec
    # cached from an earlier model keeps its own), and equal meshes are one mesh to DTensor.
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    if len(groups) <= 1 and split_over is None:  # one mesh (or none): torch's own, bit for bit
        return _whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))
    # FSDP x TP: tensor-parallel gradients live on the 2-D mesh, the others on the data-parallel
    # one, and DTensor does not mix meshes in one op: a norm per mesh, then the norm of those.
    norms = [_whole(torch.nn.utils.get_total_norm(g, norm_type)) for g in groups.values()]
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    if split_over is not None:
        total = _whole_module_norm(total, norm_type, split_over, parameters)
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grads in groups.values():
        torch._foreach_mul_(grads, coefficient)
    return total


def _whole_module_norm(
    norm: torch.Tensor, norm_type: float, group: Any, parameters: list[torch.Tensor]
) -> torch.Tensor:
    """Return the norm of every part's ``norm`` over ``group``: the p-norm of the p-norms."""
    import torch.distributed as dist

    device = parameters[0].device if parameters else norm.device  # NCCL reduces CUDA tensors
    norm = norm.to(device)
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.pow(norm_type)
    dist.all_reduce(powered, group=group)
    return powered.pow(1.0 / norm_type)


def _whole(norm: torch.Tensor) -> torch.Tensor:
    full = getattr(norm, "full_tensor", None)  # a DTensor norm of sharded gradients
    return full() if callable(full) else norm


def clip_grad_norm(
    module: torch.nn.Module, max_norm: float, *, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale ``module``'s gradients so that their total norm is at most ``max_norm``.

    Works on sharded (DTensor) gradients, computing the norm over every
    shard, and on plain ones, so one call serves every strategy; under FSDP x
    TP, whose gradients live on two meshes, it is the norm of each mesh's norms.

    Args:
        module: the wrapped module, after ``backward``.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``float("inf")`` for the largest entry).

    Returns:
        The total norm before clipping, a plain tensor, the same on every rank.

    Raises:
        UsageError: ``module`` is not a module, or ``max_norm`` or ``norm_type``
            is not a positive number.
    """
    check_module(module, "clip_grad_norm")
    ok = is_number(max_norm, above=0, finite=False)
    require(ok, "clip_grad_norm: 'max_norm'", "a positive number", max_norm)
    ok = is_number(norm_type, above=0, finite=False)
    what = "a positive number, float('inf') for the largest entry"
    require(ok, "clip_grad_norm: 'norm_type'", what, norm_type)
    part = part_of(module)  # a pipeline's stages: the norm is the whole module's
    return clip_norm_(
        list(module.parameters()), max_norm, norm_type, None if part is None else part.group
    )


def original_module(module: torch.nn.Module) -> torch.nn.Module:
    """Return the module inside a ``torch.compile`` wrapper, or ``module`` if it is not one.

    The one look inside ``torch.compile``: `compiled` and `stratagem.unwrap` both use it.
    """
    # Nothing is compiled if nobody imported torch._dynamo: no import for the check.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        inner: torch.nn.Module = module._orig_mod  # noqa: SLF001  # torch offers no other handle
        return inner
    return module
