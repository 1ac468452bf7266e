"""Host synchronisations of a step, counted where they happen.

On a GPU every read of a device value on the host (``.item()``, ``bool(t)``,
``.tolist()``) waits for the queued kernels. These all dispatch to
``aten::_local_scalar_dense`` (or ``aten::is_nonzero``), which :class:`SyncCount`
counts. A step that only preconditions reads its layers' checks (finite gradients,
whether the kept Linear rows reproduce the gradient) in one synchronisation, whatever
the number of layers; so does a distributed step on one rank. With ``sync_free=True``
such a step reads nothing at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import (
    assert_close_to_scale,
    assert_close_where_determined,
    damped_rtol,
    eigenvector_sensitivity,
    moments_tolerance,
)
from settings_keywords import with_settings
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kfac_func as kf

SYNC_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


class SyncCount(TorchDispatchMode):
    """Counts the reads of tensor values on the host: the operators behind ``.item()`` and
    ``bool(t)``, and ``Tensor.tolist`` (which reads a CPU tensor without an operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> SyncCount:
        original = self._tolist

        def counted(t: torch.Tensor) -> Any:
            self.count += 1
            return original(t)

        torch.Tensor.tolist = counted  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(48, 48), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(48, 3))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def _batch(model: nn.Module, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (rows, 2, 6, 6) if isinstance(model[0], nn.Conv2d) else (rows, 48)
    return torch.randn(shape, generator=gen), torch.randint(0, 3, (rows,), generator=gen)


@pytest.mark.parametrize(
    "make", [lambda: _mlp(2), lambda: _mlp(5), _cnn], ids=["mlp2", "mlp5", "cnn"]
)
def test_adapter_precondition_step_reads_the_device_once(make: Any) -> None:
    model = make()
    pre = kf.KFACPreconditioner(model, factor_update_steps=4, inv_update_steps=4, lr=0.1)
    x, y = _batch(model)
    counts = []
    for _ in range(4):  # step 0 updates factors and decomposes; steps 1-3 only precondition
        F.cross_entropy(model(x), y).backward()
        with SyncCount() as sc:
            pre.step()
        counts.append(sc.count)
        model.zero_grad()
    assert counts[1:] == [1, 1, 1], counts
    # the factor step reads more (finite factors, decompositions), but it did precondition
    assert counts[0] > 1


def test_rows_are_still_used_and_checked() -> None:
    """The batched check keeps deciding per layer: rows that do not reproduce the gradient
    (weight decay added to it) make that layer take its dense path, with the same result
    up to rounding as without rows."""
    model = _mlp(2).double()
    layers = kf.register(model)
    state = kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64)
    x, y = _batch(model)
    x = x.double()
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    _, state = kf.update(state, grads, captures=caps, damping=1e-2)
    bent = dict(grads)
    bent["0.weight"] = grads["0.weight"] + 1e-3 * params["0.weight"].detach()
    with SyncCount() as sc:
        with_rows, _ = kf.update(
            state, bent, captures=caps, damping=1e-2, update_factors=False, update_inverses=False
        )
    assert sc.count == 1
    dense, _ = kf.update(state, bent, damping=1e-2, update_factors=False, update_inverses=False)
    for name in grads:
        torch.testing.assert_close(with_rows[name], dense[name], rtol=1e-10, atol=1e-12)
    assert not torch.equal(with_rows["0.weight"], grads["0.weight"])


def test_update_distributed_one_rank_reads_the_device_once() -> None:
    model = _mlp(3)
    layers = kf.register(model)
    state = kf.init(layers)
    params = dict(model.named_parameters())
    x, y = _batch(model)
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    _, state = kf.distributed.update_distributed(state, grads, plan=plan, comm=comm, captures=caps)
    with SyncCount() as sc:
        kf.distributed.update_distributed(
            state,
            grads,
            plan=plan,
            comm=comm,
            captures=caps,
            update_factors=False,
            update_inverses=False,
        )
    assert sc.count == 1


# ------------------------------------------------- sync_free=True: none at all


STEP_KINDS = {
    "factors and decompositions": {},
    "factors": {"update_inverses": False},
    "decompositions": {"update_factors": False},
    "precondition only": {"update_factors": False, "update_inverses": False},
}


@pytest.mark.parametrize(
    ("method", "extra"),
    [("eigen", {}), ("inverse", {}), ("eigen", {"eigenbasis_moments": True, "moment_beta1": 0.9})],
    ids=["eigen", "inverse", "moments"],
)
@pytest.mark.parametrize("kl_clip", [1e-3, None])
def test_sync_free_update_reads_nothing(
    method: str, extra: dict[str, Any], kl_clip: float | None
) -> None:
    """No step kind of ``sync_free=True`` reads anything on the host (factors,
    decompositions, preconditioning), for any number of layers, from the first step."""
    model = _mlp(3)
    layers = kf.register(model)
    state = kf.init(layers, compute_method=method)
    params = dict(model.named_parameters())
    x, y = _batch(model)
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    kw: dict[str, Any] = {"kl_clip": kl_clip, "sync_free": True, **extra}
    counts = {}
    for kind, flags in [("first", {}), *STEP_KINDS.items(), ("again", {})]:
        with SyncCount() as sc:
            out, state = kf.update(state, grads, captures=caps, **flags, **kw)
        counts[kind] = sc.count
    assert set(counts.values()) == {0}, counts
    assert not torch.equal(out["0.weight"], grads["0.weight"])
    with SyncCount() as sc:
        kf.step.precondition_grads(state, grads, kl_clip=kl_clip, sync_free=True)
    assert sc.count == 0


@pytest.mark.parametrize(
    "settings",
    [
        {"compute_method": "ekfac"},
        {"eigenbasis_refresh": "qr"},
        {"max_factor_dim": 20},  # diagonal sides
        {"convention": "kfac-pytorch"},
    ],
    ids=["ekfac", "qr", "diagonal", "kfac-pytorch"],
)
@pytest.mark.parametrize("grouped", [True, False])
def test_sync_free_step_kinds_read_nothing_and_equal_the_default(
    settings: dict[str, Any], grouped: bool
) -> None:
    model = _mlp(3).double()
    layers = kf.register(model, max_factor_dim=settings.get("max_factor_dim"))
    init = {k: v for k, v in settings.items() if k != "max_factor_dim"}
    states = {
        sf: kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64, **init)
        for sf in (False, True)
    }
    params = dict(model.named_parameters())
    moments = settings.get("eigenbasis_refresh") == "qr"
    # the QR refresh is a function of the factor and of the previous eigenvectors, which a
    # null space (8 rows, 48 wide) leaves free: any rounding rotates them (the sync-free step
    # decomposes equal-shaped layers in one batched call), and the refresh carries that
    # rotation into the factor's range. More rows than the width leave none.
    x, y = _batch(model, rows=64 if moments else 8)
    for i, flags in enumerate([{}, *STEP_KINDS.values(), {}]):
        _, grads, caps = kf.capture(
            model, params, x.double() * (1 + 0.1 * i), lambda out: F.cross_entropy(out, y)
        )
        outs = {}
        for sf in (False, True):
            with SyncCount() as sc:
                outs[sf], states[sf] = kf.update(
                    states[sf],
                    grads,
                    captures=caps,
                    sync_free=sf,
                    grouped=grouped,
                    eigenbasis_moments=moments,
                    kl_clip=None if moments else 1e-3,
                    **flags,
                )
            if sf:
                assert sc.count == 0, (i, flags)
        # Two roundings of one step (the sync-free step decomposes equal-shaped layers in
        # one batched call). The moments are compared where the factors determine them
        # (eigenvalues above 1e-6 of the largest, isolated: see moments_tolerance); the
        # damped steps to their condition number, in the dtype of the eigendecomposition
        # (kfac-pytorch's runs in float32); EKFAC's corrected eigenvalues also follow the
        # eigenvectors, as sensitive as the gaps.
        ref = states[False]
        if moments:
            tol = moments_tolerance(ref, torch.float64)
            assert_close_where_determined(outs[True], outs[False], ref, **tol)
            continue
        eigh_dtype = torch.float32 if init.get("convention") == "kfac-pytorch" else torch.float64
        rtol = damped_rtol(ref, 1e-3, eigh_dtype)
        if init.get("compute_method") == "ekfac":
            rtol *= eigenvector_sensitivity(ref)
        assert_close_to_scale(outs[True], outs[False], rtol=min(rtol, 1e-3))


def test_sync_free_update_distributed_one_rank_reads_nothing() -> None:
    model = _mlp(3)
    layers = kf.register(model)
    params = dict(model.named_parameters())
    x, y = _batch(model)
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    _, state = kf.distributed.update_distributed(
        kf.init(layers), grads, plan=plan, comm=comm, captures=caps
    )
    with SyncCount() as sc:
        kf.distributed.update_distributed(
            state,
            grads,
            plan=plan,
            comm=comm,
            update_factors=False,
            update_inverses=False,
            sync_free=True,
        )
    assert sc.count == 0


@pytest.mark.parametrize(
    "kw",
    [{}, {"compute_method": "inverse"}, {"kl_clip": None}],
    ids=["eigen", "inverse", "no-kl-clip"],
)
@pytest.mark.parametrize("make", [lambda: _mlp(2), _cnn], ids=["mlp2", "cnn"])
def test_sync_free_adapter_steps_read_nothing(make: Any, kw: dict[str, Any]) -> None:
    model = make()
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=4,
        inv_update_steps=4,
        lr=0.1,
        **with_settings(settings=kf.Settings(sync_free=True), **kw),
    )
    x, y = _batch(model)
    counts = []
    for _ in range(5):  # steps 0 and 4 update factors and decompose; 1-3 only precondition
        F.cross_entropy(model(x), y).backward()
        with SyncCount() as sc:
            pre.step()
        counts.append(sc.count)
        model.zero_grad()
    assert counts == [0, 0, 0, 0, 0], counts  # the factor steps too
    with SyncCount() as sc:
        assert pre.report_skipped() == {}
    assert sc.count == 1  # one read of all counters
