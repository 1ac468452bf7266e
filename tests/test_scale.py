"""At the size people train: a GPT-2-small-shaped model built from its config (124 M
parameters, d 768, a 3,072-wide MLP, the 50,257-row head tied to the embedding).

``kf.KFAC(model)`` trains a few steps; its state, at run time and in ``state_dict()``, is
held to a bound derived from the layer shapes and the recipe (every tensor the recipe
keeps, counted from the shapes: no timing), which is itself within SOAP's 2.6× the
parameters' bytes; ``state_dict()`` / ``load_state_dict()`` and a DCP save and load
(``kf.save_dcp`` / ``kf.load_dcp``) round-trip the state exactly. ``KFACPreconditioner``
with kfac-pytorch's defaults does the same on the first two blocks (its whole factors,
3,072 wide, decomposed). The timings of the same paths are ``benchmarks/scale.py``'s.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
from torch import nn

import kfac_func as kf
from kfac_func.state import KFACState
from kfac_func.step.orthogonal import takes_orthogonal

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

SOAP = 2.6
"""heavyball SOAP's state over the parameters' bytes on this model (two factors and two
eigenbases per matrix, Adam's moments): the bound of the recommended recipe's."""


def _gpt2(layers: int = 12) -> nn.Module:
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers)
    return transformers.GPT2LMHeadModel(cfg).train()


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _state_bytes(state: KFACState, storages: bool = True) -> int:
    """Bytes of every tensor of a K-FAC state: each storage once (what the state keeps
    alive), or each tensor's own elements (``storages=False``)."""
    leaves = optree.tree_leaves(state)  # type: ignore[arg-type]
    if not storages:
        return sum(t.numel() * t.element_size() for t in leaves)
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves}
    return sum(seen.values())


def _dict_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_dict_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_dict_bytes(v) for v in tree)
    return 0


def _recipe_bound(opt: kf.KFAC, model: nn.Module) -> tuple[int, int]:
    """``(run time, checkpoint)`` bytes of the recommended recipe's state, from the
    shapes: per layer on the orthogonalized step its A (``k`` blocks of ``w²``), their
    eigenvectors and eigenvalues, the power of A (run time only), its diagonal G and
    G's eigenvalues, one momentum of the gradient matrix's size; per other layer its
    factors and their eigenpairs (:func:`_factors_and_eigenpairs`), ``1/(dg daᵀ + λ)``
    where both sides are dense, and two moments; AdamW's
    two moments (and its step counter) per other parameter. float32."""
    pre = opt.preconditioner
    run = saved = 0
    for spec in pre.layers.values():
        a_shape, g_shape = spec.factor_shapes
        a, g, matrix = _numel(a_shape), _numel(g_shape), _numel(spec.matrix_shape)
        if pre.orthogonal is not None and takes_orthogonal(spec, pre.orthogonal):
            k, w = spec.a_blocks, spec.a_block_width
            assert spec.g_diagonal and a == k * w * w
            kept = a + (a + k * w) + g + g + matrix
            run, saved = run + kept + a, saved + kept
            continue
        outer = matrix if not any(spec.diagonal) else 0
        kept = _factors_and_eigenpairs(spec) + outer + 2 * matrix
        run, saved = run + kept, saved + kept
    mine = {p for s in pre.layers.values() for p in s.param_names()}
    others = sum(2 * p.numel() + 1 for n, p in model.named_parameters() if n not in mine)
    return 4 * (run + others), 4 * (saved + others)


def _factors_and_eigenpairs(spec: Any) -> int:
    """Elements of a layer's two factors and their eigendecompositions: a dense side
    (``(..., n, n)``) its factor, eigenvectors and eigenvalues; a diagonal one (``(..., n)``)
    its factor and eigenvalues."""
    total = 0
    for shape, diagonal in zip(spec.factor_shapes, spec.diagonal):
        total += 2 * _numel(shape) + (0 if diagonal else _numel(shape[:-1]))
    return total


def _train(model: nn.Module, step: Any, steps: int, zero: Any) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator())
    for _ in range(steps):
        zero()
        model(ids, labels=ids).loss.backward()
        step()


def _same(a: KFACState, b: KFACState) -> None:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)  # type: ignore[arg-type]
    assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_the_recommended_recipe_at_gpt2_small(tmp_path: Path) -> None:
    model = _gpt2()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = kf.KFAC(model)
    _train(model, opt.step, 3, opt.zero_grad)
    pre = opt.preconditioner
    wide = [s for s in pre.layers.values() if s.a_blocks > 1]
    assert len(wide) == 48 and all(s.a_block_width <= 512 for s in wide)
    run_bound, saved_bound = _recipe_bound(opt, model)
    assert run_bound <= SOAP * params, run_bound / params

    base = sum(_dict_bytes(dict(o.state)) for o in opt.optimizers)
    run = _state_bytes(pre.state) + base
    assert run <= run_bound, (run, run_bound)
    usage = pre.memory_usage()
    assert usage["total"] - usage["hook_buffers"] == _state_bytes(pre.state)

    sd = opt.state_dict()
    assert _dict_bytes(sd) <= saved_bound, (_dict_bytes(sd), saved_bound)
    fresh_model = _gpt2()
    fresh = kf.KFAC(fresh_model)
    fresh.load_state_dict(sd)
    _same(fresh.preconditioner.state, _without_powers(pre.state))

    dcp_model = _gpt2()
    dcp_opt = kf.KFAC(dcp_model)
    with warnings.catch_warnings():  # DCP without a process group
        warnings.simplefilter("ignore", UserWarning)
        kf.save_dcp({"optim": opt.state_dict()}, tmp_path / "ckpt")
        template = {"optim": dcp_opt.state_dict()}
        kf.load_dcp(template, tmp_path / "ckpt")
    dcp_opt.load_state_dict(template["optim"])
    _same(dcp_opt.preconditioner.state, _without_powers(pre.state))


def _without_powers(state: KFACState) -> KFACState:
    """The state as a load gives it back: the orthogonalized step's powers, derived from
    the decompositions, are recomputed at the next step instead of saved."""
    layers = {n: ls.replace(ortho_power=None) for n, ls in state.layers.items()}
    return state.replace(layers=layers)


def test_kfac_pytorch_defaults_on_two_gpt2_small_blocks(tmp_path: Path) -> None:
    """Whole factors, 3,072 wide (the MLP's), eigendecomposed: the state is what the
    shapes say (A, G, their eigenpairs, ``1/(dg daᵀ + λ)``), and it round-trips."""
    model = _gpt2(layers=2)
    pre = kf.KFACPreconditioner(model, inv_update_steps=10)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        pre.step()
        sgd.step()

    _train(model, step, 2, sgd.zero_grad)
    want = 0
    for spec in pre.layers.values():
        want += _factors_and_eigenpairs(spec)
        want += _numel(spec.matrix_shape) if not any(spec.diagonal) else 0
    assert max(s.a_dim for s in pre.layers.values()) == 3073
    # (the storages hold 2 % more: a layer preconditioned alone keeps its decomposition
    # as a view of the batched eigh's stack, which also held those since restacked)
    assert _state_bytes(pre.state, storages=False) == 4 * want
    sd = pre.state_dict()
    again = kf.KFACPreconditioner(_gpt2(layers=2), inv_update_steps=10)
    again.load_state_dict(sd)
    _same(again.state, pre.state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        kf.save_dcp({"kfac": pre.state_dict()}, tmp_path / "ckpt")
        other = kf.KFACPreconditioner(_gpt2(layers=2), inv_update_steps=10)
        template = {"kfac": other.state_dict()}
        kf.load_dcp(template, tmp_path / "ckpt")
    other.load_state_dict(template["kfac"])
    _same(other.state, pre.state)
