"""Diagonal factor sides (``register(..., max_factor_dim=...)``) against dense
computations written here, in float64, through ``update``, the adapter, the distributed
step's single-rank path and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.checkpoint.state_format import META_KEY

DT = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5, dtype=DT), nn.Tanh(), nn.Linear(5, 9, dtype=DT))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, generator=g, dtype=DT), torch.randint(0, 9, (6,), generator=g)


def test_table_states_the_diagonal_sides() -> None:
    table = kf.register(_model(), max_factor_dim=6)
    assert table["0"].diagonal == (False, False)
    assert table["2"].diagonal == (False, True)
    assert table["2"].factor_shapes == ((6, 6), (9,))
    assert "diagonal G" in str(table)
    with pytest.raises(ValueError, match="max_factor_dim must be a positive int"):
        kf.register(_model(), max_factor_dim=0)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_diagonal_g_is_the_diagonal_of_the_dense_g(method: str) -> None:
    model = _model()
    x, y = _batch()
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    dense = kf.init(kf.register(model), compute_method=method, factor_dtype=DT, inv_dtype=DT)
    diag = kf.init(
        kf.register(model, max_factor_dim=6), compute_method=method, factor_dtype=DT, inv_dtype=DT
    )
    lam = 0.03
    _, dense = kf.update(dense, grads, captures=caps, damping=lam, kl_clip=None)
    out, diag = kf.update(diag, grads, captures=caps, damping=lam, kl_clip=None)
    ld, lg = dense.layers["2"], diag.layers["2"]
    torch.testing.assert_close(lg.g_factor, torch.diagonal(ld.g_factor), rtol=1e-13, atol=0)
    torch.testing.assert_close(lg.a_factor, ld.a_factor, rtol=0, atol=0)
    # the preconditioned gradient with diag(G) written out densely
    m = torch.cat([grads["2.weight"], grads["2.bias"][:, None]], dim=1)
    g_full, a_full = torch.diag(lg.g_factor), lg.a_factor
    if method == "eigen":
        curv = torch.kron(g_full, a_full) + lam * torch.eye(m.numel(), dtype=DT)
        want = torch.linalg.solve(curv, m.reshape(-1)).reshape(m.shape)
    else:
        eye = torch.eye(6, dtype=DT)
        want = (1 / (lg.g_factor + lam))[:, None] * m @ torch.linalg.inv(a_full + lam * eye)
    got = torch.cat([out["2.weight"], out["2.bias"][:, None]], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    if method == "eigen":
        assert lg.decomposition is not None and lg.decomposition.qg is None  # type: ignore[union-attr]


def test_kfac_pytorch_convention_starts_a_diagonal_factor_at_ones() -> None:
    state = kf.init(kf.register(_model(), max_factor_dim=6), convention="kfac-pytorch")
    assert torch.equal(state.layers["2"].g_factor, torch.ones(9))


def test_adapter_and_distributed_single_rank_agree_with_update() -> None:
    model = _model()
    x, y = _batch()
    table = kf.register(model, max_factor_dim=6)
    plan = kf.distributed.make_plan(table, 1)
    comm = kf.distributed.Communicator(plan)
    s1 = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    s2 = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    for _ in range(2):
        _, grads, caps = kf.capture(
            model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
        )
        o1, s1 = kf.update(s1, grads, captures=caps, damping=0.01)
        o2, s2 = kf.distributed.update_distributed(
            s2, grads, captures=caps, plan=plan, comm=comm, damping=0.01
        )
        for k in o1:
            torch.testing.assert_close(o1[k], o2[k], rtol=0, atol=0)
    pre = kf.KFACPreconditioner(
        model,
        settings=kf.Settings(max_factor_dim=6, scaling="fisher"),
        factor_dtype=DT,
        inv_dtype=DT,
        damping=0.01,
    )
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert pre.state.layers["2"].g_factor.shape == (9,)
    sd = pre.state_dict()
    pre.load_state_dict(sd, compute_inverses=False)
    assert sd["layers"]["2"]["G"].shape == (9,)
    pre.load_state_dict(sd)  # decomposition from the state dict
    assert pre.state.layers["2"].decomposition is not None


def test_checkpoints_round_trip_and_older_checkpoints_load() -> None:
    model = _model()
    x, y = _batch()
    table = kf.register(model, max_factor_dim=6)
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    _, state = kf.update(state, grads, captures=caps)
    d = kf.state_to_dict(state, include_decompositions=True)
    back = kf.state_from_dict(d, like=state)
    dec = back.layers["2"].decomposition
    assert dec is not None and dec.qg is None  # type: ignore[union-attr]
    assert torch.equal(dec.dg, state.layers["2"].decomposition.dg)  # type: ignore[union-attr]
    # a checkpoint written before LayerSpec had `diagonal` (dense layers) still loads
    dense = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
    old = kf.state_to_dict(dense)
    meta = json.loads(bytes(old[META_KEY].tolist()).decode())
    for layer in meta["layers"]:
        del layer["spec"]["diagonal"]
    old[META_KEY] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    kf.state_from_dict(old, like=dense)
    with pytest.raises(kf.checkpoint.CheckpointMismatchError, match="diagonal"):
        kf.state_from_dict(old, like=state)
