"""Checkpoints on ``torch.distributed.checkpoint``: portable, atomic, safe to read.

``save(path, state, ctx)`` writes a directory; ``load(path, state, ctx)``
restores modules, optimizers and objects in place and returns the plain
values; ``describe(path)`` lists what a checkpoint holds; ``latest(dir)``
finds the newest one; ``exists(path)`` says whether there is one to load
(rather than ``os.path.exists``); ``per_rank(value)`` marks an entry each rank saves and
restores for itself (every other entry is saved from rank 0).
``export_weights``/``import_weights`` write and read a module's weights in the
formats people share (a consolidated ``.pt``, safetensors). See
``docs/checkpoints.md``.
"""

from stratagem.checkpoint.background import PendingSave as PendingSave
from stratagem.checkpoint.directory import exists as exists
from stratagem.checkpoint.directory import latest as latest
from stratagem.checkpoint.entries import PerRank as PerRank
from stratagem.checkpoint.entries import per_rank as per_rank
from stratagem.checkpoint.entries import unwrap as unwrap
from stratagem.checkpoint.resuming import resume_or_start as resume_or_start
from stratagem.checkpoint.saving import load as load
from stratagem.checkpoint.saving import save as save
from stratagem.checkpoint.summary import Description as Description
from stratagem.checkpoint.summary import TensorInfo as TensorInfo
from stratagem.checkpoint.summary import describe as describe
from stratagem.checkpoint.weights import export_weights as export_weights
from stratagem.checkpoint.weights import import_weights as import_weights
from stratagem.errors import CheckpointError as CheckpointError

__all__ = [
    "CheckpointError",
    "Description",
    "PendingSave",
    "PerRank",
    "TensorInfo",
    "describe",
    "exists",
    "export_weights",
    "import_weights",
    "latest",
    "load",
    "per_rank",
    "resume_or_start",
    "save",
    "unwrap",
]
