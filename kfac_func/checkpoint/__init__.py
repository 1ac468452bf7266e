"""Checkpoints of K-FAC states: the errors (:mod:`~kfac_func.checkpoint.errors`), the
format (:mod:`~kfac_func.checkpoint.state_format`), flat tensor dicts
(:mod:`~kfac_func.checkpoint.state_dict`) and state files
(:mod:`~kfac_func.checkpoint.state_files`), atomic ``torch.distributed.checkpoint``
directories (:mod:`~kfac_func.checkpoint.atomic_dcp`), and per-layer factor directories
written by the ranks that own the factors (:mod:`~kfac_func.checkpoint.factor_dir`, with
their manifest in :mod:`~kfac_func.checkpoint.factor_manifest`).

The state files, state dicts, DCP directories and :class:`CheckpointError` are also at the
top level (``kf.save_state``, ...); the factor directories and the finer errors are here.

Example:
    >>> from kfac_func.checkpoint import CheckpointFormatError, CheckpointError
    >>> issubclass(CheckpointFormatError, CheckpointError)
    True
"""

from kfac_func.checkpoint.atomic_dcp import load_dcp, save_dcp
from kfac_func.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from kfac_func.checkpoint.factor_dir import load_factor_dir, save_factor_dir
from kfac_func.checkpoint.factor_manifest import layer_file_name, read_factor_manifest
from kfac_func.checkpoint.state_dict import state_from_dict, state_to_dict
from kfac_func.checkpoint.state_files import load_state, save_state

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "layer_file_name",
    "load_dcp",
    "load_factor_dir",
    "load_state",
    "read_factor_manifest",
    "save_dcp",
    "save_factor_dir",
    "save_state",
    "state_from_dict",
    "state_to_dict",
]
