"""``compiled``: ``torch.compile`` around the module that the inner ``wrap`` returns.

Compiling after the inner wrap puts the compiler around DDP (whose
``DDPOptimizer`` then splits graphs at bucket boundaries) rather than inside
it. ``torch._dynamo`` takes seconds to import, so nothing here imports it
before a strategy is applied; checking the options imports it then.

With ``blocks=`` (a policy ``module -> bool``, as ``fsdp()``'s ``shard_when``)
each picked submodule is compiled on its own, in place, before the inner wrap
shards it, as torchtitan compiles each transformer block: the graphs stay
small and FSDP's hooks stay outside them.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import attrs
import torch

from stratagem.combinators._base import check_once, check_strategy, outermost_picks
from stratagem.env import Context
from stratagem.errors import UsageError, describe
from stratagem.fields import WrapFn
from stratagem.strategy import Strategy

__all__ = ["CompiledWrap", "compiled"]


@contextlib.contextmanager
def _torch_import_warnings_ignored() -> Iterator[None]:
    # The first torch.compile imports inductor, whose imports (torch.utils.mkldnn) use
    # torch.jit.script_method and so warn about torch's own code; under -W error that would
    # abort the import halfway. The warning is not the user's to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning
        )
        yield


@attrs.frozen
class CompiledWrap:
    """Wrap: the inner wrap, then ``torch.compile`` of what it returned.

    Attributes:
        inner: the wrap being extended.
        options: the keyword arguments of ``torch.compile``, as sorted ``(name, value)``
            pairs (a tuple keeps the record immutable and its repr readable).
    """

    inner: WrapFn
    options: tuple[tuple[str, Any], ...] = ()
    blocks: Callable[[torch.nn.Module], bool] | None = None

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        if self.blocks is None:
            wrapped = self.inner(module, ctx)
            with _torch_import_warnings_ignored():
                return cast(torch.nn.Module, torch.compile(wrapped, **dict(self.options)))
        blocks = outermost_picks(module, self.blocks, f"compiled(blocks={self.blocks!r})")
        with _torch_import_warnings_ignored():
            for block in blocks:  # in place: the names (and checkpoints) stay as they were
                block.compile(**dict(self.options))
        return self.inner(module, ctx)


_NOT_OPTIONS = ("model",)  # the module comes from wrap


def _check_names(options: dict[str, Any]) -> None:
    accepted = [p for p in inspect.signature(torch.compile).parameters if p not in _NOT_OPTIONS]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise UsageError(
            f"compiled: torch.compile has no option {', '.join(map(repr, unknown))}; its "
            f"options are {', '.join(accepted)} (the module itself comes from wrap)."
        )
    if options.get("mode") is not None and options.get("options") is not None:
        raise UsageError(
            f"compiled: give 'mode' or 'options', not both (got mode={options['mode']!r} and "
            f"options={options['options']!r}); torch.compile refuses the pair."
        )


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x


def _check_values(options: dict[str, Any]) -> None:
    # torch.compile validates mode, backend and inductor options when called, before compiling
    # anything: ask it now, so a typo fails here and not in every rank at wrap.
    try:
        with _torch_import_warnings_ignored():
            torch.compile(_probe, **options)
    except Exception as error:  # torch raises RuntimeError, InvalidBackend, AssertionError
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
        raise UsageError(
            f"compiled: torch.compile rejects {shown} ({type(error).__name__}: "
            f"{str(error)[:300]}). Fix the option, or leave it out for torch's default."
        ) from None


def compiled(
    strategy: Strategy,
    *,
    blocks: Callable[[torch.nn.Module], bool] | None = None,
    **torch_compile_options: Any,
) -> Strategy:
    """Compile the wrapped module with ``torch.compile(**torch_compile_options)``.

    With ``blocks``, compile each submodule the policy picks instead, one by
    one and before the inner wrap (per-block compile, as torchtitan does);
    the root and the wrappers around it are not compiled.

    The module is compiled after the inner ``wrap`` (so around DDP or FSDP, as
    torch recommends); ``step`` calls the compiled module as it would the plain
    one, so autocast and the user's forward are unchanged. ``sg.unwrap`` and
    checkpoints see through the compiled wrapper.

    Fields touched: ``wrap`` (`CompiledWrap`) only. The other fields receive
    the compiled module, as they receive whatever ``wrap`` returned; the
    built-ins' ``no_sync`` look under the compiler (`original_module`), so
    ``compiled`` and ``accumulate`` compose in either order.

    Args:
        strategy: the strategy whose modules to compile.
        blocks: ``None`` (compile the whole wrapped module), or a policy
            ``module -> bool`` such as ``sg.every_module_of(Block)``.
        **torch_compile_options: keyword arguments of ``torch.compile``
            (``mode``, ``backend``, ``fullgraph``, ``dynamic``, ``options``, ...).

    Returns:
        The strategy with a compiling ``wrap``.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, an option is not one of
            ``torch.compile``'s, or
            ``torch.compile`` rejects its value (checking imports ``torch._dynamo``,
            a few seconds, once per process).
        CombinatorError: the strategy is already compiled.
    """
    check_strategy(strategy, "compiled")
    check_once(strategy, CompiledWrap, "compiled", "is already compiled", "apply compiled once")
    if blocks is not None and not callable(blocks):
        raise UsageError(
            f"compiled: 'blocks' must be a function module -> bool or None (got "
            f"{describe(blocks)}), e.g. blocks=sg.every_module_of(MyBlock)."
        )
    _check_names(torch_compile_options)
    _check_values(torch_compile_options)
    options = tuple(sorted(torch_compile_options.items()))
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+compiled",
        wrap=CompiledWrap(strategy.wrap, options, blocks),
    )
