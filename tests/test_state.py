"""State pytrees: optree and torch.func see tensors as leaves, metadata as static."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

import kfac_func as kf


def _trained_state() -> tuple[kf.KFACState, kf.Captures]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    x = torch.randn(5, 2, 6, 6)
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.pow(2).mean())
    state = kf.init(kf.register(model))
    return kf.update(state, grads, captures=caps)[1], caps


def test_optree_paths_and_tree_map() -> None:
    state, _ = _trained_state()
    paths, leaves, spec = optree.tree_flatten_with_path(state)
    assert ("layers", "0", "a_factor") in paths
    assert ("layers", "2", "decomposition", "qg") in paths
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    doubled = optree.tree_map(lambda t: t.double(), state)
    assert isinstance(doubled, kf.KFACState)
    assert doubled.step == state.step and doubled.config == state.config
    assert doubled.layers["0"].spec == state.layers["0"].spec
    assert doubled.layers["0"].a_factor.dtype == torch.float64
    assert doubled.layers["0"].a_factor.shape == (2, 10, 10)  # 1 channel x 3x3 + bias
    assert optree.tree_structure(doubled) == spec


def test_static_metadata_is_not_a_leaf() -> None:
    state = kf.init(kf.register(nn.Linear(3, 2)))
    leaves = optree.tree_leaves(state)
    assert len(leaves) == 2  # A and G; no decomposition yet, counters are static


def test_torch_pytree_and_torch_func_accept_state() -> None:
    state, _ = _trained_state()
    leaves, spec = torch_pytree.tree_flatten(state)
    assert len(leaves) == len(optree.tree_leaves(state))
    assert isinstance(torch_pytree.tree_unflatten(leaves, spec), kf.KFACState)

    def total(s: kf.KFACState) -> torch.Tensor:
        return sum(ls.a_factor.sum() + ls.g_factor.sum() for ls in s.layers.values())  # type: ignore[return-value]

    grads = torch.func.grad(total)(state)
    assert isinstance(grads, kf.KFACState)
    torch.testing.assert_close(grads.layers["2"].a_factor, torch.ones(65, 65))


def test_captures_are_pytrees_too() -> None:
    _, caps = _trained_state()
    paths = optree.tree_paths(caps)
    assert ("layers", "0", "inputs", 0) in paths and ("layers", "2", "output_grads", 0) in paths
    halved = optree.tree_map(lambda t: t / 2, caps)
    assert halved.batch_size == caps.batch_size and halved.loss_scale == caps.loss_scale


def test_frozen() -> None:
    state, _ = _trained_state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.layers["0"].a_factor = torch.zeros(1)  # type: ignore[misc]
    assert state.replace(step=7).step == 7 and state.step == 1


def test_init_device_and_dtypes() -> None:
    layers = kf.register(nn.Conv2d(3, 6, 2, groups=3, bias=False))
    state = kf.init(layers, convention="kfac-pytorch", factor_dtype=torch.float64, device="cpu")
    a = state.layers[""].a_factor
    assert a.shape == (3, 4, 4) and a.dtype == torch.float64
    torch.testing.assert_close(a, torch.eye(4, dtype=torch.float64).expand(3, 4, 4))
