"""torch.func capture: gradients, inputs and output-gradients against plain autograd."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf


def _autograd_reference(
    model: nn.Module, names: list[str], x: torch.Tensor, loss_fn: Any
) -> tuple[
    torch.Tensor,
    dict[str, torch.Tensor],
    dict[str, list[torch.Tensor]],
    dict[str, list[torch.Tensor]],
]:
    """Loss, grads, inputs and output-gradients with ordinary autograd and retained outputs."""
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = []
    for n in names:

        def hook(
            mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, n: str = n
        ) -> None:
            inputs[n].append(args[0].detach())
            outputs[n].append(out)

        handles.append(model.get_submodule(n).register_forward_hook(hook))
    try:
        loss = loss_fn(model(x))
    finally:
        for h in handles:
            h.remove()
    params = dict(model.named_parameters())
    flat_out = [o for n in names for o in outputs[n]]
    got = torch.autograd.grad(loss, [*params.values(), *flat_out])
    grads = dict(zip(params, got[: len(params)]))
    it = iter(got[len(params) :])
    out_grads = {n: [next(it) for _ in outputs[n]] for n in names}
    return loss.detach(), grads, inputs, out_grads


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(h.flatten(1))


def test_matches_autograd_including_rng_and_buffers() -> None:
    torch.manual_seed(0)
    model = Net().double()
    ref_model = Net().double()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))

    def loss_fn(o: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o, y)

    names = ["conv", "fc"]
    torch.manual_seed(123)
    loss, grads, caps = kf.capture(model, dict(model.named_parameters()), x, loss_fn)
    torch.manual_seed(123)
    ref_loss, ref_grads, ref_in, ref_out = _autograd_reference(ref_model, names, x, loss_fn)

    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-14)
    assert set(grads) == set(ref_grads)
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-12, atol=1e-14)
        assert grads[k].grad_fn is None
    for n in names:
        torch.testing.assert_close(caps.layers[n].inputs[0], ref_in[n][0], rtol=0, atol=0)
        torch.testing.assert_close(
            caps.layers[n].output_grads[0], ref_out[n][0], rtol=1e-12, atol=1e-14
        )
    # BatchNorm running statistics moved exactly as in one ordinary forward
    for a, b in zip(model.buffers(), ref_model.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert caps.batch_size == 6 and caps.loss_scale == pytest.approx(1 / 6)


class Twice(nn.Module):
    """One Linear applied twice (weight sharing), as in an unrolled recurrence."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.cell(torch.tanh(self.cell(x)))))


def test_module_called_twice_gives_one_update_with_both_calls_rows() -> None:
    torch.manual_seed(1)
    model = Twice().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, loss_fn, loss_reduction="sum"
    )
    _, _ref_grads, ref_in, ref_out = _autograd_reference(model, ["cell", "head"], x, loss_fn)
    cell = caps.layers["cell"]
    assert len(cell.inputs) == 2 and len(cell.output_grads) == 2
    for k in range(2):
        torch.testing.assert_close(cell.inputs[k], ref_in["cell"][k], rtol=0, atol=0)
        torch.testing.assert_close(cell.output_grads[k], ref_out["cell"][k], rtol=1e-12, atol=1e-14)
    # the shared weight's gradient is the sum of both calls' contributions
    gw = sum(g.T @ a for g, a in zip(cell.output_grads, cell.inputs))
    torch.testing.assert_close(grads["cell.weight"], gw, rtol=1e-12, atol=1e-14)

    state = kf.init(kf.register(model), factor_dtype=torch.float64, inv_dtype=torch.float64)
    new = kf.step.accumulate_factors(state, caps)
    assert new.layers["cell"].factor_updates == 1
    rows = torch.cat([torch.cat([a, torch.ones(5, 1, dtype=a.dtype)], 1) for a in ref_in["cell"]])
    torch.testing.assert_close(new.layers["cell"].a_factor, rows.T @ rows / 10, rtol=1e-12, atol=0)
    r = torch.cat(ref_out["cell"])
    # sum-reduced loss: per-example gradients are the raw ones; G = (1/N) Σ over all rows
    torch.testing.assert_close(new.layers["cell"].g_factor, r.T @ r / 5, rtol=1e-12, atol=0)


def test_mc_fisher_keeps_true_gradients_and_is_reproducible() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(16, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (16,))
    params = dict(model.named_parameters())
    loss_fn = lambda o: F.cross_entropy(o, y)  # noqa: E731
    _, g_emp, c_emp = kf.capture(model, params, x, loss_fn)
    runs = [
        kf.capture(
            model,
            params,
            x,
            loss_fn,
            fisher="mc",
            likelihood="cross_entropy",
            generator=torch.Generator().manual_seed(7),
        )
        for _ in range(2)
    ]
    for _, g_mc, c_mc in runs:
        for k in g_emp:
            torch.testing.assert_close(g_mc[k], g_emp[k], rtol=0, atol=0)
        # per-example sampled gradient p - onehot, scaled like the mean loss
        r = c_mc.layers["2"].output_grads[0] * 16
        torch.testing.assert_close(r.sum(-1), torch.zeros(16, dtype=r.dtype), rtol=0, atol=1e-12)
        assert ((r < 0).sum(-1) == 1).all()
    torch.testing.assert_close(
        runs[0][2].layers["0"].output_grads[0], runs[1][2].layers["0"].output_grads[0]
    )
    assert not torch.allclose(
        runs[0][2].layers["2"].output_grads[0], c_emp.layers["2"].output_grads[0]
    )


def test_mc_mse_uses_unit_gaussian_noise() -> None:
    model = nn.Linear(3, 2).double()
    x = torch.randn(4000, 3, dtype=torch.float64)
    _, _, caps = kf.capture(
        model,
        dict(model.named_parameters()),
        x,
        lambda o: o.pow(2).mean(),
        fisher="mc",
        likelihood="mse",
        loss_reduction="sum",
        generator=torch.Generator().manual_seed(0),
    )
    r = caps.layers[""].output_grads[0]
    cov = r.T @ r / r.shape[0]
    torch.testing.assert_close(cov, torch.eye(2, dtype=cov.dtype), rtol=0, atol=0.06)


def test_pytree_outputs_and_kwargs() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.b = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
            return {"a": self.a(x) * scale, "b": self.b(x)}

    model = TwoHeads()
    x = torch.randn(4, 3)
    _loss, grads, caps = kf.capture(
        model,
        dict(model.named_parameters()),
        x,
        lambda o: o["a"].sum() + o["b"].sum(),
        kwargs={"scale": 2.0},
    )
    torch.testing.assert_close(grads["a.bias"], torch.full((2,), 8.0))
    torch.testing.assert_close(caps.layers["a"].output_grads[0], torch.full((4, 2), 2.0))


def test_layer_not_called_has_empty_capture_and_keeps_state() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return model["used"](x)

    model.forward = fwd  # type: ignore[method-assign]
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), torch.randn(3, 2), lambda o: o.sum()
    )
    assert caps.layers["unused"].inputs == ()
    state = kf.init(kf.register(model))
    new_grads, new = kf.update(state, grads, captures=caps)
    assert new.layers["unused"].factor_updates == 0 and new.layers["unused"].decomposition is None
    torch.testing.assert_close(new_grads["unused.weight"], grads["unused.weight"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fisher": "exact"}, "fisher must be"),
        ({"fisher": "mc"}, "likelihood"),
        ({"fisher": "mc", "likelihood": "poisson"}, "likelihood"),
        ({"loss_reduction": "none"}, "loss_reduction"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        kf.capture(
            model, dict(model.named_parameters()), torch.randn(3, 2), lambda o: o.sum(), **kwargs
        )


def test_explicit_batch_size_and_sum_reduction() -> None:
    model = nn.Linear(2, 2)
    x = torch.randn(3, 5, 2)  # (T, B, d) layout: the batch is dimension 1 here
    _, _, caps = kf.capture(
        model,
        dict(model.named_parameters()),
        x,
        lambda o: o.sum(),
        batch_size=5,
        loss_reduction="sum",
    )
    assert (caps.batch_size, caps.loss_scale) == (5, 1.0)


def test_a_module_under_two_names_keeps_its_parameters() -> None:
    """torch.func.functional_call leaves a module reachable under two attribute names
    holding the call's tensors; capture (and everything built on it) gives the module its
    own parameters back, so that the model and its optimizer still share them."""

    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.alias = self.lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.alias(torch.tanh(self.lin(x)))

    torch.manual_seed(0)
    model = Aliased()
    own = dict(model.named_parameters())
    other = {k: v.detach() + 1.0 for k, v in own.items()}
    x = torch.randn(4, 3)
    kf.capture(model, other, x, lambda out: out.pow(2).mean())
    assert all(dict(model.named_parameters())[k] is p for k, p in own.items())
    assert model.alias.weight is own["lin.weight"]
    expected = model(x)
    ones = {k: torch.ones_like(v) for k, v in other.items()}
    kf.step.curvature_gram(model, other, x, [ones], loss="mse")
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert isinstance(model.lin.weight, nn.Parameter)
