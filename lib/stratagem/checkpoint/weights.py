"""Weights in the formats people share: a consolidated ``.pt`` and Hugging Face safetensors.

`export_weights` gathers a module's full state (every shard, whatever the
strategy) and rank 0 writes it; `import_weights` reads one on rank 0, checks
every name and shape against the module, and only then gives each rank its
part (its shard under fsdp or tensor parallel, the whole under ddp). The format
follows the path: ``.pt``/``.pth``/``.bin`` is ``torch.save`` of ``{name:
tensor}`` (read with ``weights_only=True``, as the FSDP2 example writes it),
``.safetensors`` one safetensors file, and a directory a sharded safetensors
export with ``model.safetensors.index.json``. Names are those of the plain
module (no ``module.`` or ``_orig_mod.``), as `stratagem.checkpoint.save` keys
them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from stratagem.checkpoint import safetensor_files
from stratagem.checkpoint.directory import WEIGHT_FILES, checked_path
from stratagem.checkpoint.entries import listing, settle, unwrap
from stratagem.checkpoint.rank_zero import on_main
from stratagem.env import Context, check_context
from stratagem.errors import CheckpointError, UsageError, describe, error_line
from stratagem.parts import part_of
from stratagem.validators import is_int, refusal, require

__all__ = ["export_weights", "import_weights", "weights_format"]


def weights_format(path: Path) -> str:
    """Return ``"pt"``, ``"safetensors"`` or ``"sharded"``: what ``path`` holds or will hold."""
    return WEIGHT_FILES.get(path.suffix.lower(), "sharded")


def _checked(path: object, module: object, ctx: object, function: str) -> tuple[Path, Any]:
    target = checked_path(path, function)
    check_context(ctx, function)
    if not isinstance(module, torch.nn.Module):
        hint = "; pass what wrap returned"
        raise refusal(f"{function}: 'module'", "a torch.nn.Module", module, hint=hint)
    if part_of(module) is not None:
        raise UsageError(
            f"{function}: {type(module).__name__} is one rank's part of a pipeline; each rank "
            "holds other layers, so there is no whole module here to export or import. Use "
            "sg.checkpoint.save and load, which keep every stage's part."
        )
    return target, settle(unwrap(module))


def export_weights(
    path: str | os.PathLike[str],
    module: torch.nn.Module,
    ctx: Context,
    *,
    shard_bytes: int | None = None,
) -> None:
    """Write ``module``'s full weights to ``path`` in a shared format; every rank calls it.

    The format follows ``path`` (see the module docstring). Rank 0 writes a
    file beside ``path`` and renames it into place, so a failed export leaves
    what was at ``path`` whole; a sharded export goes into a new directory
    (one that exists is refused, so an export never half replaces another).

    Args:
        path: the file or directory; the same on every rank.
        module: what ``wrap`` returned (DDP, FSDP, tensor parallel or plain).
        ctx: the joined world.
        shard_bytes: for a directory, the most bytes of tensors per shard file
            (``None``: 5 GB, as Hugging Face shards).

    Raises:
        UsageError: a bad argument, or a sharded export into an existing directory.
        CheckpointError: the file could not be written (every rank raises).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    target, plain = _checked(path, module, ctx, "export_weights")
    kind = weights_format(target)
    limit = 5 * 10**9 if shard_bytes is None else shard_bytes
    what = "a positive int or None"
    require(is_int(limit, 1), "export_weights: 'shard_bytes'", what, shard_bytes)
    if shard_bytes is not None and kind != "sharded":
        raise UsageError(
            f"export_weights: 'shard_bytes' shards a directory export, but {target.name} is "
            f"one {kind} file; pass a directory path, or leave shard_bytes out."
        )
    # Every rank takes part; rank 0 gets the whole state on the CPU, the others {}.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(plain, options=options))
    on_main(ctx, lambda: _write(target, kind, state, limit))


def _write(target: Path, kind: str, state: dict[str, torch.Tensor], limit: int) -> None:
    tensors = {name: value.detach().cpu().contiguous() for name, value in state.items()}
    if kind == "sharded" and target.exists():
        raise UsageError(
            f"export_weights: {target} exists; export into a new directory (an export is "
            "never written over another, so a failed one cannot lose it)."
        )
    # Written beside the target, then renamed into place: a failed export leaves it whole.
    tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
    try:
        if kind == "pt":
            with open(tmp, "wb") as file:
                torch.save(tensors, file)
                file.flush()
                os.fsync(file.fileno())
        elif kind == "safetensors":
            safetensor_files.write(tmp, tensors, {"format": "pt"})
        else:
            _write_shards(tmp, tensors, limit)
        os.replace(tmp, target)
    except OSError as error:
        raise CheckpointError(f"export_weights: cannot write {target}: {error}") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)


def _write_shards(tmp: Path, tensors: dict[str, torch.Tensor], limit: int) -> None:
    """Write ``tensors`` into the new directory ``tmp``: shards of ``limit`` bytes, and an index."""
    tmp.mkdir(parents=False)
    groups: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and used + size > limit:
            groups.append({})
            used = 0
        groups[-1][name] = tensor
        used += size
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        safetensor_files.write(tmp / shard, group, {"format": "pt"})
        weight_map |= dict.fromkeys(group, shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / safetensor_files.INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Return the tensors at ``path`` (rank 0 only), refusing what is not a weights file."""
    kind = weights_format(path)
    if kind == "safetensors":
        return safetensor_files.read(path)
    if kind == "sharded":
        if not (path / safetensor_files.INDEX).is_file():
            raise CheckpointError(
                f"import_weights: {path} is neither a .pt/.pth/.bin or .safetensors file nor a "
                f"directory holding {safetensor_files.INDEX}."
            )
        weights = safetensor_files.read_index(path)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(set(weights.values())):
            held = safetensor_files.read(path / file)
            named = {name for name, shard in weights.items() if shard == file}
            if set(held) != named:
                raise CheckpointError(
                    f"{path / file} holds {sorted(set(held) ^ named)[:5]} that "
                    f"{safetensor_files.INDEX} places elsewhere (or not at all)."
                )
            tensors.update(held)
        return tensors
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an unpickling refusal names the global it would not run
        raise CheckpointError(
            f"import_weights: cannot read {path} as torch.save weights ({error_line(error)})."
        ) from None
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        shown = (
            "a dict of " + ", ".join(sorted({type(v).__name__ for v in loaded.values()}))
            if isinstance(loaded, Mapping)
            else describe(loaded)
        )
        raise CheckpointError(
            f"import_weights: {path} holds {shown}, not {{name: tensor}}; if the weights are "
            "one entry of it (say state['model']), torch.save that entry alone."
        )
    return dict(loaded)


def _mismatch(found: Mapping[str, torch.Tensor], wanted: Mapping[str, torch.Size]) -> str | None:
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted))
    shapes = sorted(
        k for k in set(found) & set(wanted) if tuple(found[k].shape) != tuple(wanted[k])
    )
    problems = [
        f"{label} {listing(keys, shown=5)}"
        for label, keys in (("missing", missing), ("not in the module", unexpected))
        if keys
    ]
    problems += [
        f"{key} is {list(found[key].shape)} in the file, {list(wanted[key])} in the module"
        for key in shapes[:5]
    ]
    return "; ".join(problems) if problems else None


def import_weights(path: str | os.PathLike[str], module: torch.nn.Module, ctx: Context) -> None:
    """Load the weights at ``path`` into ``module``, in place; every rank calls it.

    Rank 0 reads the file and compares every name and shape with ``module``
    before anything is loaded: a file that does not match changes nothing and
    every rank raises the same error. Then each rank receives its part (its
    shard under fsdp or tensor parallel). Values are converted to the
    module's dtypes, as ``load_state_dict`` converts them.

    Args:
        path: a ``.pt``/``.pth``/``.bin`` or ``.safetensors`` file, or a
            directory holding a sharded safetensors export.
        module: what ``wrap`` returned.
        ctx: the joined world.

    Raises:
        UsageError: a bad argument.
        CheckpointError: the file cannot be read, is not a weights file, or
            does not match ``module`` (every rank raises).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    target, plain = _checked(path, module, ctx, "import_weights")
    # A DTensor's shape is the whole tensor's: the file is compared with the unsharded module.
    live = cast(dict[str, torch.Tensor], get_model_state_dict(plain))
    wanted = {name: value.shape for name, value in live.items()}

    def read_and_check() -> None:
        tensors = _read(target)
        problem = _mismatch(tensors, wanted)
        if problem is not None:
            raise CheckpointError(
                f"import_weights: {target} does not match {type(plain).__name__}: {problem}. "
                "Nothing was loaded."
            )
        held.update(tensors)

    held: dict[str, torch.Tensor] = {}
    on_main(ctx, read_and_check)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.world_size > 1)
    with torch.no_grad():
        set_model_state_dict(plain, cast(dict[str, Any], held), options=options)
