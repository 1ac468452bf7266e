"""Peak memory of a step, counted in live tensor bytes (deterministic, not measured RSS).

:class:`LiveBytes` follows every tensor storage that exists when it is entered or that an
operator creates inside it, and drops a storage's bytes when the storage is freed. The
peak it reports is what a step adds at its worst moment to what was alive before it.

What is checked: ``update(..., donate=True)`` frees each layer's old factors and
decomposition as soon as their replacements exist (without donation the old and the new
state are alive together), gives the same results as without donation, and the adapter
(which donates on one process) neither holds two states during ``step()`` nor lets the
autograd graph keep its batch statistics alive after it.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kfac_func as kf
from kfac_func.distributed.kaisa import local_batch_factors
from kfac_func.step.precondition import captured_rows

F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


class LiveBytes(TorchDispatchMode):
    """Bytes of live CPU tensor storages: ``now``, and ``peak - entry`` as :attr:`added`.

    Storages are keyed by their C++ object and followed with a finalizer on the Python
    storage object, which torch keeps alive for as long as the storage itself lives
    (also when only the autograd graph or a view holds it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.finalizers: list[weakref.finalize] = []
        self.now = self.peak = self.entry = 0

    def __enter__(self) -> LiveBytes:
        gc.collect()
        for obj in gc.get_objects():
            # type(), not isinstance(): some module objects warn when their __class__ is read
            if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
                self._follow(obj)
        self.entry = self.peak = self.now
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for f in self.finalizers:
            f.detach()

    @property
    def added(self) -> int:
        """The peak minus the bytes alive at entry."""
        return self.peak - self.entry

    def _follow(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return
        key, n = st._cdata, st.nbytes()
        if key not in self.sizes:
            f = weakref.finalize(st, self._freed, key)
            f.atexit = False
            self.finalizers.append(f)
            self.sizes[key] = 0
        self.now += n - self.sizes[key]
        self.sizes[key] = n
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._follow(t)
        return out


def _nbytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in optree.tree_leaves(tree)
        if isinstance(t, torch.Tensor)
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    dims = [40, 48, 48, 48, 6]
    mods: list[nn.Module] = []
    for i in range(4):
        mods += [nn.Linear(dims[i], dims[i + 1]), nn.Tanh()]
    return nn.Sequential(*mods[:-1]).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 40, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 6, (16,), generator=gen)


def _captured(model: nn.Module) -> tuple[dict[str, torch.Tensor], kf.Captures]:
    x, y = _batch()
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    return grads, caps


def _state_sizes(state: kf.KFACState) -> tuple[int, int]:
    """Bytes of the whole state's tensors and of its largest layer's."""
    per_layer = [_nbytes(ls) for ls in state.layers.values()]
    return sum(per_layer), max(per_layer)


def _update_peak(donate: bool) -> tuple[int, int, int]:
    """(bytes one update adds at its peak, state bytes, largest layer's bytes); the
    caller's only reference to the old state is the one it hands to update."""
    model = _model()
    grads, caps = _captured(model)
    state = kf.init(kf.register(model), convention="kfac-pytorch", **F64)
    _, state = kf.update(state, grads, captures=caps)  # decompositions exist now
    total, largest = _state_sizes(state)
    with LiveBytes() as live:
        _, state = kf.update(state, grads, captures=caps, donate=donate)
    return live.added, total, largest


def test_donated_update_frees_the_old_state_layer_by_layer() -> None:
    kept, total, largest = _update_peak(donate=False)
    donated, _, _ = _update_peak(donate=True)
    # without donation the whole new state is alive next to the old one at the peak;
    # with it, at most one layer's old tensors are alive next to their replacements
    assert kept >= total, (kept, total)
    assert kept - donated >= total - largest, (kept, donated, total, largest)


@pytest.mark.parametrize(
    "init",
    [
        {"compute_method": "eigen"},
        {"compute_method": "inverse"},
        {"compute_method": "eigen", "eigenbasis_refresh": "qr"},
        {"compute_method": "eigen", "compute_eigenvalue_outer_product": False},
    ],
)
def test_donated_update_gives_the_same_results(init: dict[str, Any]) -> None:
    model = _model()
    grads, caps = _captured(model)
    kept = kf.init(kf.register(model), convention="kfac-pytorch", **F64, **init)
    donated = copy.deepcopy(kept)
    schedule = [(True, True), (True, False), (False, True), (True, True)]
    for update_factors, update_inverses in schedule:
        kw = dict(
            captures=caps,
            damping=0.01,
            update_factors=update_factors,
            update_inverses=update_inverses,
        )
        before = copy.deepcopy(kept)
        g_kept, new_kept = kf.update(kept, grads, **kw)
        handed = donated
        g_donated, donated = kf.update(donated, grads, donate=True, **kw)
        assert optree.tree_structure(kept) == optree.tree_structure(before)
        assert all(map(torch.equal, optree.tree_leaves(kept), optree.tree_leaves(before)))
        kept = new_kept
        assert g_kept.keys() == g_donated.keys()
        assert all(torch.equal(g_kept[k], g_donated[k]) for k in g_kept)
        assert optree.tree_structure(kept) == optree.tree_structure(donated)
        assert all(map(torch.equal, optree.tree_leaves(kept), optree.tree_leaves(donated)))
        # the donated state was updated in place: its dict is the new state's
        assert handed.layers is donated.layers and donated.step == handed.step + 1


@pytest.mark.parametrize("fault", ["shape", "missing"])
def test_donated_update_refuses_bad_gradients_before_changing_anything(fault: str) -> None:
    model = _model()
    grads, caps = _captured(model)
    state = kf.init(kf.register(model), convention="kfac-pytorch", **F64)
    _, state = kf.update(state, grads, captures=caps)
    before = dict(state.layers)
    bad = dict(grads)
    if fault == "shape":
        bad["4.weight"] = grads["4.weight"][:, :-1]
        match = r"layer '4' \(linear\): weight gradient must have shape \(48, 48\)"
    else:
        del bad["6.bias"]
        match = r"layer '6': no gradient for \['6.bias'\]"
    with pytest.raises(ValueError, match=match):
        kf.update(state, bad, captures=caps, donate=True)
    assert state.layers == before  # every layer state is the same object as before
    assert all(state.layers[k] is v for k, v in before.items())


def test_donated_batch_factors_and_rows_are_consumed() -> None:
    model = _model()
    grads, caps = _captured(model)
    state = kf.init(kf.register(model), convention="kfac-pytorch", **F64)
    batch = local_batch_factors(state, caps)
    rows = captured_rows(state, caps)
    expect_grads, expect = kf.update(copy.deepcopy(state), grads, captures=caps)
    got_grads, got = kf.update(state, grads, batch_factors=batch, rows=rows, donate=True)
    assert batch == {} and rows == {}
    assert all(torch.equal(expect_grads[k], got_grads[k]) for k in expect_grads)
    assert all(map(torch.equal, optree.tree_leaves(expect), optree.tree_leaves(got)))


def _adapter_after_one_step() -> tuple[nn.Module, kf.KFACPreconditioner]:
    model = _model()
    pre = kf.KFACPreconditioner(model, damping=0.01, **F64)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    model.zero_grad()
    return model, pre


def test_adapter_step_holds_one_state() -> None:
    model, pre = _adapter_after_one_step()
    total, _ = _state_sizes(pre.state)
    x, y = _batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with LiveBytes() as live:
        pre.step()
    # two states alive together (the old one held until the step returns) would add at
    # least `total`; the step adds its preconditioned gradients and one layer's tensors
    assert live.added < total // 2, (live.added, total)


def test_adapter_step_does_not_leave_statistics_to_the_graph() -> None:
    model, pre = _adapter_after_one_step()
    x, y = _batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with LiveBytes() as live:
        pre.step()
        with_graph = live.now
        del loss  # the graph holds the adapter's gradient hooks
        gc.collect()
        without_graph = live.now
    # the smallest statistic the hooks collect (the last layer's 6x6 G Gram, float64) is
    # 288 bytes; the graph itself holds nothing after backward but the 8-byte loss
    assert with_graph - without_graph < 256, (with_graph, without_graph)


def test_adapter_state_read_before_a_step_is_untouched() -> None:
    model, pre = _adapter_after_one_step()
    seen = pre.state
    snapshot = copy.deepcopy(seen)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert pre.state is not seen and pre.state.layers is not seen.layers
    assert seen.step == snapshot.step == pre.steps - 1
    assert all(map(torch.equal, optree.tree_leaves(seen), optree.tree_leaves(snapshot)))
    assert not all(map(torch.equal, optree.tree_leaves(seen), optree.tree_leaves(pre.state)))
