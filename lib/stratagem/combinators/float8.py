"""``with_float8``: the linear layers a policy picks train in float8 (torchao's float8 training).

Each picked ``torch.nn.Linear`` becomes torchao's ``Float8Linear`` before the
inner ``wrap`` shards or replicates the module, as torchtitan converts before
it parallelises: its matrix multiplies take float8 inputs, scaled per tensor
(``"tensorwise"``) or per row (``"rowwise"``, ``"rowwise_with_gw_hp"``), and the
weights, their gradients and the optimizer stay in their own dtype. Names
and parameters do not change, so checkpoints load into a strategy without it.

torchao is an optional extra (``pip install 'stratagem[float8]'``), imported
at ``wrap`` only. A float8 matrix multiply needs a GPU of compute capability
8.9 or more (Ada, Hopper); elsewhere (the CPU, older GPUs) torchao emulates it
in float32 with float8 rounding, which gives the same numbers more slowly, so
the same stack runs and is tested on the CPU. ``emulate=None`` decides at
``wrap`` from ``ctx.device``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, ClassVar, Literal, get_args

import attrs
import torch

from stratagem.combinators._base import check_once, check_strategy
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.fields import WrapFn
from stratagem.strategy import Strategy
from stratagem.validators import decision, require

__all__ = ["Float8Recipe", "Float8Wrap", "float8_linears", "with_float8"]

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
RECIPES: tuple[str, ...] = get_args(Float8Recipe)

MISSING = (
    "with_float8: torchao is not installed; install it with pip install 'stratagem[float8]' "
    "(or pip install torchao)."
)


def float8_linears(module: torch.nn.Module) -> bool:
    """Default policy: a ``torch.nn.Linear`` whose features are multiples of 16 (float8's tiles).

    Example:
        >>> float8_linears(torch.nn.Linear(64, 32)), float8_linears(torch.nn.Linear(64, 10))
        (True, False)

    Raises:
        UsageError: ``module`` is not a ``torch.nn.Module``.
    """
    require(
        isinstance(module, torch.nn.Module), "float8_linears: 'module'", "a torch.nn.Module", module
    )
    return (
        type(module) is torch.nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def _native(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 matrices itself (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _torchao_float8() -> Any:
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as error:
        raise UsageError(MISSING) from error


@attrs.frozen
class Float8Wrap:
    """Wrap field: convert the linear layers ``policy`` picks to float8, then run ``inner``.

    Attributes:
        inner: the wrap it runs after converting.
        policy: which ``torch.nn.Linear`` submodules to convert (``module -> bool``).
        recipe: torchao's scaling recipe.
        emulate: torchao's emulation (float32 with float8 rounding); ``None``:
            emulated unless ``ctx.device`` multiplies float8 natively.
    """

    inner: WrapFn
    policy: Callable[[torch.nn.Module], bool]
    recipe: str = "tensorwise"
    emulate: bool | None = None
    compute_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn  # what the kit's tolerances read

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        float8 = _torchao_float8()
        emulate = self.emulate
        if emulate is None:
            emulate = not _native(check_context(ctx, "wrap").device)
        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name(self.recipe), emulate=emulate
        )
        float8.convert_to_float8_training(
            module,
            config=config,
            module_filter_fn=lambda child, name: decision(
                self.policy, child, "with_float8's policy", name
            ),
        )
        return self.inner(module, ctx)


def with_float8(
    strategy: Strategy,
    *,
    modules: Callable[[torch.nn.Module], bool] = float8_linears,
    recipe: Float8Recipe = "tensorwise",
    emulate: bool | None = None,
) -> Strategy:
    """Train the linear layers ``modules`` picks in float8, with torchao.

    Fields touched: ``wrap`` only (`Float8Wrap`, before the inner wrap), so it
    composes with ``ddp()``, ``fsdp()`` and the other combinators as any wrap
    layer does. torchao converts only ``torch.nn.Linear`` layers; ``modules``
    is asked of each of them (default `float8_linears`; torchtitan also keeps
    the output layer in high precision: ``lambda m: sg.float8_linears(m) and
    m is not model.output`` cannot pickle, so pick by shape or type instead).

    Args:
        strategy: the strategy to train in float8.
        modules: a policy ``module -> bool`` over the ``Linear`` layers.
        recipe: ``"tensorwise"`` (one scale per tensor), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"`` (a scale per row; the weight gradient
            in high precision), torchao's recipe names.
        emulate: float8 emulated in float32 (``True``), native (``False``,
            compute capability 8.9 or more), or chosen at ``wrap`` from the
            device (``None``).

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, ``modules`` is not
            callable, ``recipe`` is unknown, ``emulate`` not None or a bool,
            or torchao is not installed.
        CombinatorError: the strategy already trains in float8.

    Example:
        >>> import stratagem as sg
        >>> sg.with_float8(sg.fsdp(), recipe="rowwise").name
        'fsdp+float8'
    """
    check_strategy(strategy, "with_float8")
    wanted = "a function module -> bool (e.g. sg.float8_linears)"
    require(callable(modules), "with_float8: 'modules'", wanted, modules)
    known = isinstance(recipe, str) and recipe in RECIPES
    require(known, "with_float8: 'recipe'", f"one of {', '.join(map(repr, RECIPES))}", recipe)
    ok = emulate is None or isinstance(emulate, bool)
    require(ok, "with_float8: 'emulate'", "None (by device), True or False", emulate)
    if importlib.util.find_spec("torchao") is None:  # before any rank starts, without importing
        raise UsageError(MISSING)
    check_once(strategy, Float8Wrap, "with_float8", "already trains in float8")
    wrap = Float8Wrap(strategy.wrap, modules, recipe, emulate)
    return attrs.evolve(strategy, name=f"{strategy.name}+float8", wrap=wrap)
