"""Checkpoints of the parallel preconditioner: kfac-pytorch-shaped state dicts gathered
across ranks, and the per-layer factor files of ``factor_checkpoint_dir``.

``state_dict`` gathers every layer of every pipeline stage from its owner;
``load_state_dict`` restores it on any rank. With ``factor_checkpoint_dir`` the factors go
to one file per layer instead (:func:`kfac_func.checkpoint.save_factor_dir`), written by the layer's
owner and read back by it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from kfac_func.adapter.arguments import HYPER
from kfac_func.adapter.checkpoint_settings import (
    hyperparameter_entries,
    load_hyperparameters,
    meaning_settings,
    warn_replaced,
)
from kfac_func.checkpoint.factor_dir import load_factor_dir, save_factor_dir
from kfac_func.core.decomposition import DECOMPOSITIONS
from kfac_func.parallel.base import ParallelBase
from kfac_func.state import KFACState, LayerState
from kfac_func.step.decompose import decompose_layer

__all__ = ["ParallelCheckpointing"]


class ParallelCheckpointing(ParallelBase):
    """``state_dict``, ``load_state_dict`` and the factor directory of the parallel
    preconditioner (a base class). Each method is a collective: every rank calls it."""

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's shape, gathered across ranks: every rank returns ``steps``, the
        non-callable hyperparameters and ``layers: {name: {"A", "G", ...}}`` of every layer
        of every stage (each from its owner). With ``factor_checkpoint_dir`` the factors
        go to one file per layer there instead (see :meth:`save_factors_to_dir`). A
        collective: every rank calls it."""
        sd = hyperparameter_entries(self, meaning_settings(self._world_state(), False))
        if not include_factors:
            return sd
        if self.factor_checkpoint_dir is not None:
            self.save_factors_to_dir()
            return sd
        mine = {}
        for name, ls in self._state.layers.items():
            if not self._owner(name):
                continue
            entry: dict[str, Any] = {
                "A": ls.a_factor.cpu(),
                "G": ls.g_factor.cpu(),
                "factor_updates": ls.factor_updates,
            }
            if ls.decomposition is not None:
                entry["decomposition"] = {
                    k: v.cpu()
                    for k, v in vars(ls.decomposition).items()
                    if isinstance(v, torch.Tensor)
                }
            mine[name] = entry
        merged: dict[str, Any] = {}
        for part in self.comm.all_gather_object(mine):
            merged.update(part)
        sd["layers"] = {name: merged[name] for name in self.all_specs}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` (of any rank); with ``factor_checkpoint_dir`` the
        factors come from there. A layer's owner takes its decompositions from the state
        dict, or recomputes them with ``compute_inverses``; the other ranks hold none
        (they neither decompose nor precondition the layer). A collective: every rank
        calls it."""
        sd = dict(state_dict)
        # the settings that decide what the factors mean must match (a ValueError names
        # them); hyperparameters are restored, with a warning naming those this
        # constructor chose otherwise than the checkpoint's run
        chosen, old = load_hyperparameters(self, sd, meaning_settings(self._world_state(), False))
        steps = int(sd.pop("steps"))
        layers_sd = sd.pop("layers", None)
        warn_replaced(chosen, old, {key: getattr(self, key) for key in HYPER}, stacklevel=2)
        self._state = self._state.replace(step=steps)
        if self.factor_checkpoint_dir is not None:
            self.load_factors_from_dir(compute_inverses)
            return
        if layers_sd is None:
            return
        missing = sorted(set(self.layers) - set(layers_sd))
        if missing:
            raise ValueError(
                f"state_dict has no factors for layers {missing} (rank {self.comm.rank})"
            )
        cfg = self._state.config
        layers = dict(self._state.layers)
        for name, ls in layers.items():
            entry = layers_sd[name]
            a, g = entry["A"], entry["G"]
            a_shape, g_shape = ls.spec.factor_shapes
            if tuple(a.shape) != a_shape or tuple(g.shape) != g_shape:
                raise ValueError(
                    f"layer {name!r}: state_dict factors have shapes {tuple(a.shape)} and "
                    f"{tuple(g.shape)}, expected {a_shape} and {g_shape}"
                )
            dev = ls.a_factor.device
            new = ls.replace(
                a_factor=a.to(dev, cfg.factor_dtype, copy=True),
                g_factor=g.to(dev, cfg.factor_dtype, copy=True),
                factor_updates=int(entry.get("factor_updates", max(1, ls.factor_updates))),
                decomposition=None,
            )
            dec = entry.get("decomposition")
            if not self._owner(name):
                pass  # only a layer's owner decomposes it and preconditions its gradient
            elif dec is not None:
                cls = DECOMPOSITIONS[cfg.compute_method]
                new = new.replace(decomposition=cls(**{k: v.to(dev) for k, v in dec.items()}))
            elif compute_inverses:
                new = new.replace(
                    decomposition=decompose_layer(new, float(self._value(self.damping)), cfg)
                )
            layers[name] = new
        self._state = self._state.replace(layers=layers)

    def _world_state(self) -> KFACState:
        """This rank's state widened to every layer of every stage (others' entries are
        empty placeholders), as the factor-file functions expect."""
        empty = torch.empty(0, dtype=self.factor_dtype)
        layers = {
            name: self._state.layers.get(name) or LayerState(empty, empty, None, spec)
            for name, spec in self.all_specs.items()
        }
        return self._state.replace(layers=layers)

    def save_factors_to_dir(self) -> None:
        """Write one checkpoint file per layer (by its owner) and a manifest to
        ``factor_checkpoint_dir`` (:func:`kfac_func.checkpoint.save_factor_dir`). A collective."""
        if self.factor_checkpoint_dir is None:
            raise ValueError("factor_checkpoint_dir is None")
        save_factor_dir(
            self._world_state(),
            self.factor_checkpoint_dir,
            plan=self.world_plan,
            include_decompositions=True,
        )

    def load_factors_from_dir(self, compute_inverses: bool = True) -> None:
        """Read the owned layers' factors from ``factor_checkpoint_dir``. A collective.

        As in kfac-pytorch, a ``factor_checkpoint_dir`` that is not a directory (no
        checkpoint was saved yet) only warns and keeps the current factors; a directory
        without a complete checkpoint raises
        :class:`~kfac_func.checkpoint.state_files.CheckpointFormatError`.
        """
        if self.factor_checkpoint_dir is None:
            raise ValueError("factor_checkpoint_dir is None")
        if not os.path.isdir(self.factor_checkpoint_dir):
            warnings.warn(  # kfac-pytorch's wording
                f"factor_checkpoint_dir={self.factor_checkpoint_dir} is not a directory. "
                "Skipping KFAC checkpoint load.",
                stacklevel=2,
            )
            return
        loaded = load_factor_dir(
            self.factor_checkpoint_dir,
            like=self._world_state(),
            plan=self.world_plan,
            only_owned=True,
        )
        cfg = self._state.config
        layers = dict(self._state.layers)
        for name in layers:
            if not self._owner(name):
                continue
            ls = loaded.layers[name]
            if ls.decomposition is None and compute_inverses:
                ls = ls.replace(
                    decomposition=decompose_layer(ls, float(self._value(self.damping)), cfg)
                )
            layers[name] = ls
        self._state = self._state.replace(layers=layers, step=loaded.step)
