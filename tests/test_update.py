"""`update` and its stages: running averages, schedules, micro-batches, bad input."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


def _setup(seed: int = 0, n: int = 8, **init: Any) -> tuple[nn.Module, kf.KFACState, Any, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (n,))
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    state = kf.init(kf.register(model), **{**F64, **init})
    return model, state, grads, caps


def _leaves_equal(a: Any, b: Any) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb))


def _batch_factors(
    state: kf.KFACState, caps: kf.Captures, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    spec, cfg = state.layers[name].spec, state.config
    lc = caps.layers[name]
    a = kf.core.a_factor(spec, lc.inputs, cfg.convention, cfg.factor_dtype)
    g = kf.core.g_factor(
        spec,
        lc.output_grads,
        cfg.convention,
        cfg.factor_dtype,
        batch_size=caps.batch_size,
        loss_scale=caps.loss_scale,
    )
    return a, g


@pytest.mark.parametrize("convention", ["fisher", "kfac-pytorch"])
def test_running_average_and_initial_value(convention: str) -> None:
    _, state, _grads, caps = _setup(convention=convention)
    a, _g = _batch_factors(state, caps, "0")
    s1 = kf.step.accumulate_factors(state, caps, factor_decay=0.9)
    s2 = kf.step.accumulate_factors(s1, caps, factor_decay=0.9)
    expect1 = a if convention == "fisher" else 0.9 * torch.eye(4, dtype=a.dtype) + 0.1 * a
    torch.testing.assert_close(s1.layers["0"].a_factor, expect1, rtol=1e-14, atol=0)
    torch.testing.assert_close(s2.layers["0"].a_factor, 0.9 * expect1 + 0.1 * a, rtol=1e-14, atol=0)
    assert s2.layers["0"].factor_updates == 2 and state.layers["0"].factor_updates == 0


def test_factor_decay_one_keeps_factors() -> None:
    _, state, _, caps = _setup(convention="kfac-pytorch")
    s = kf.step.accumulate_factors(state, caps, factor_decay=1.0)
    torch.testing.assert_close(s.layers["2"].g_factor, state.layers["2"].g_factor, rtol=0, atol=0)


def test_update_is_pure() -> None:
    _, state, grads, caps = _setup()
    state = kf.update(state, grads, captures=caps)[1]  # holds a decomposition now
    before = copy.deepcopy((state, grads, caps))
    new_grads, new_state = kf.update(state, grads, captures=caps, kl_clip=None)
    assert _leaves_equal((state, grads, caps), before)
    assert new_state is not state and new_grads is not grads
    assert not torch.equal(new_grads["0.weight"], grads["0.weight"])
    with pytest.raises(AttributeError):
        state.step = 5  # type: ignore[misc]


def test_intervals_reuse_factors_and_decompositions() -> None:
    _, state, grads, caps = _setup()
    _, s1 = kf.update(state, grads, captures=caps)
    _, s2 = kf.update(s1, grads, update_factors=False, update_inverses=False)
    assert s2.step == 2
    for name in s1.layers:
        assert s2.layers[name].a_factor is s1.layers[name].a_factor
        assert s2.layers[name].decomposition is s1.layers[name].decomposition
    # schedules are callables of the step
    _, s3 = kf.update(
        s2,
        grads,
        captures=caps,
        update_factors=lambda k: k % 2 == 0,
        update_inverses=lambda k: False,
    )
    assert s3.layers["0"].factor_updates == 2
    assert s3.layers["0"].decomposition is s1.layers["0"].decomposition


def test_first_update_without_factors_passes_gradients_through() -> None:
    _, state, grads, _ = _setup()
    out, new = kf.update(state, grads, update_factors=False)
    assert all(ls.decomposition is None for ls in new.layers.values())
    for k in grads:
        torch.testing.assert_close(out[k], grads[k], rtol=0, atol=0)


def test_hyperparameter_callables_receive_the_step() -> None:
    _, state, grads, caps = _setup()
    seen: list[int] = []

    def damping(step: int) -> float:
        seen.append(step)
        return 0.01

    _, s = kf.update(state, grads, captures=caps, damping=damping)
    kf.update(s, grads, captures=caps, damping=damping)
    assert set(seen) == {0, 1}
    a, _ = kf.update(
        s, grads, captures=caps, damping=0.01, lr=lambda k: 0.5, kl_clip=lambda k: 1e-3
    )
    b, _ = kf.update(s, grads, captures=caps, damping=lambda k: 0.01, lr=0.5, kl_clip=1e-3)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("convention", ["fisher", "kfac-pytorch"])
def test_micro_batches_form_one_update(convention: str) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    params = dict(model.named_parameters())
    x = torch.randn(12, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (12,))

    def cap(sl: slice) -> kf.Captures:
        return kf.capture(model, params, x[sl], lambda o: F.cross_entropy(o, y[sl]))[2]

    state = kf.init(kf.register(model), convention=convention, **F64)  # type: ignore[arg-type]
    full = kf.step.accumulate_factors(state, cap(slice(0, 12)), factor_decay=0.5)
    halves = [cap(slice(0, 4)), cap(slice(4, 12))]
    micro = kf.step.accumulate_factors(state, halves, factor_decay=0.5)
    assert micro.layers["0"].factor_updates == 1
    if convention == "fisher":
        # per-example weighting: the window equals the whole batch exactly
        for name in full.layers:
            torch.testing.assert_close(
                micro.layers[name].a_factor, full.layers[name].a_factor, rtol=1e-12, atol=0
            )
            torch.testing.assert_close(
                micro.layers[name].g_factor, full.layers[name].g_factor, rtol=1e-12, atol=0
            )
    else:
        # kfac-pytorch: micro-batch covariances are averaged with equal weights
        parts = [_batch_factors(state, c, "0") for c in halves]
        a = (parts[0][0] + parts[1][0]) / 2
        expect = 0.5 * torch.eye(4, dtype=a.dtype) + 0.5 * a
        torch.testing.assert_close(micro.layers["0"].a_factor, expect, rtol=1e-12, atol=0)


def test_low_precision_activations_accumulate_in_factor_dtype() -> None:
    torch.manual_seed(4)
    model = nn.Linear(6, 3).to(torch.bfloat16)
    x = torch.randn(10, 6, dtype=torch.bfloat16)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: o.float().pow(2).mean()
    )
    state = kf.init(kf.register(model))
    out, new = kf.update(state, grads, captures=caps)
    ls = new.layers[""]
    assert ls.a_factor.dtype == torch.float32 and ls.g_factor.dtype == torch.float32
    assert isinstance(ls.decomposition, kf.core.EigenDecomposition)
    assert ls.decomposition.qa.dtype == torch.float32
    assert out["weight"].dtype == torch.bfloat16
    exact = x.float()
    exact = torch.cat([exact, torch.ones(10, 1)], 1)
    torch.testing.assert_close(ls.a_factor, exact.T @ exact / 10, rtol=1e-6, atol=1e-6)


def test_inverse_method_state() -> None:
    _, state, grads, caps = _setup(compute_method="inverse")
    _, new = kf.update(state, grads, captures=caps, damping=0.1)
    dec = new.layers["0"].decomposition
    assert isinstance(dec, kf.core.InverseDecomposition)
    eye = torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close(
        dec.a_inv @ (new.layers["0"].a_factor + 0.1 * eye), eye, rtol=0, atol=1e-10
    )


# --- bad input -------------------------------------------------------------------------


def _poison(caps: kf.Captures, name: str, field: str, value: float) -> kf.Captures:
    lc = caps.layers[name]
    t = getattr(lc, field)[0].clone()
    t.view(-1)[0] = value
    poisoned = kf.captures.LayerCapture(
        **{**{"inputs": lc.inputs, "output_grads": lc.output_grads}, field: (t,)}
    )
    return kf.Captures({**caps.layers, name: poisoned}, caps.batch_size, caps.loss_scale)


@pytest.mark.parametrize("field", ["inputs", "output_grads"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_captures_never_enter_the_factors(field: str, value: float) -> None:
    _, state, grads, caps = _setup()
    _, state = kf.update(state, grads, captures=caps)
    bad = _poison(caps, "2", field, value)
    with pytest.raises(kf.NonFiniteError, match="layer '2'"):
        kf.update(state, grads, captures=bad, nonfinite="raise")
    with pytest.warns(RuntimeWarning, match="layer '2'.*non-finite"):
        out, new = kf.update(state, grads, captures=bad)
    # every tensor of the layer (factors, decomposition) is exactly the input state's
    assert _leaves_equal(new.layers["2"].replace(skipped_updates=0), state.layers["2"])
    assert new.layers["2"].skipped_updates == 1 and new.layers["2"].factor_updates == 1
    assert new.layers["0"].factor_updates == 2  # the healthy layer still updates
    assert all(bool(torch.isfinite(t).all()) for t in out.values())


def test_a_fold_whose_sum_overflows_is_still_taken() -> None:
    """The fold reads its checks from the sums of the folded factors first; a sum that
    overflows with every entry finite goes to the exact checks, which take the fold."""
    from kfac_func.step.accumulate import fold_deferred, fold_layers

    state = kf.init(kf.register(nn.Linear(3, 2)))  # float32 factors
    ls = state.layers[""]
    big = torch.diag(torch.full((4,), 3e38))  # finite entries, sum 1.2e39: inf in float32
    ls = ls.replace(a_factor=big, factor_updates=1)
    a, g = torch.diag(torch.full((4,), 2e38)), torch.eye(2)
    new, checks = fold_deferred(ls, a, g, 0.5, state.config)
    assert not torch.isfinite(new.a_factor.sum()) and torch.isfinite(new.a_factor).all()
    assert checks is None  # every check passed: nothing left to settle
    torch.testing.assert_close(new.a_factor, 0.5 * big + 0.5 * a, rtol=0, atol=0)
    assert new.skipped_updates == 0 and new.factor_updates == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported as non-finite
        layers = {"": ls}
        fold_layers(layers, lambda n, _: (a, g, 1.0), 0.5, state.config, "skip")
    torch.testing.assert_close(layers[""].a_factor, new.a_factor, rtol=0, atol=0)
    assert layers[""].skipped_updates == 0 and layers[""].factor_updates == 2


def test_a_gradient_whose_sum_overflows_is_still_preconditioned() -> None:
    """The default mode reads a lone layer's gradient check from the sum of its matrix; a
    sum that overflows with every entry finite goes to the exact check, and the gradient
    is preconditioned like any other (the same numbers as grouped, which checks each
    entry's extremes)."""
    state = kf.decompose(
        kf.init(kf.register(nn.Linear(2, 2)), convention="kfac-pytorch"), damping=1.0
    )
    grads = {"weight": torch.full((2, 2), 3e38), "bias": torch.zeros(2)}
    assert not torch.isfinite(grads["weight"].sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported as non-finite
        alone = kf.step.precondition_grads(state, grads, kl_clip=None, grouped=False)
    stacked = kf.step.precondition_grads(state, grads, kl_clip=None, grouped=True)
    # identity factors damped by 1: the gradient halved, not passed through unchanged
    torch.testing.assert_close(alone["weight"], grads["weight"] / 2, rtol=0, atol=0)
    torch.testing.assert_close(alone["weight"], stacked["weight"], rtol=0, atol=0)


def test_nonfinite_gradients_are_named_and_passed_through() -> None:
    _, state, grads, caps = _setup()
    bad = dict(grads)
    bad["0.bias"] = grads["0.bias"].clone()
    bad["0.bias"][1] = float("nan")
    with pytest.raises(kf.NonFiniteError, match=r"layer '0'.*0\.weight"):
        kf.update(state, bad, captures=caps, nonfinite="raise")
    with pytest.warns(RuntimeWarning, match="layer '0'"):
        out, _ = kf.update(state, bad, captures=caps)
    assert out["0.bias"] is bad["0.bias"] and out["0.weight"] is bad["0.weight"]
    assert not torch.equal(out["2.weight"], grads["2.weight"])


def test_shape_mismatches_name_layer_and_shapes() -> None:
    _, state, grads, caps = _setup()
    wrong = {**grads, "2.weight": torch.zeros(4, 6, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"layer '2'.*\(4, 5\).*\(4, 6\)"):
        kf.update(state, wrong, captures=caps)
    lc = caps.layers["0"]
    bad_caps = kf.Captures(
        {
            **caps.layers,
            "0": kf.captures.LayerCapture(
                (torch.zeros(8, 7, dtype=torch.float64),), lc.output_grads
            ),
        },
        caps.batch_size,
        caps.loss_scale,
    )
    with pytest.raises(ValueError, match=r"layer '0'.*last dimension 3.*\(8, 7\)"):
        kf.update(state, grads, captures=bad_caps)
    missing = {k: v for k, v in grads.items() if k != "2.bias"}
    with pytest.raises(ValueError, match=r"layer '2'.*2\.bias"):
        kf.update(state, missing, captures=caps)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"factor_decay": -0.1}, "factor_decay must be in"),
        ({"factor_decay": 1.5}, "factor_decay must be in"),
        ({"damping": -1.0}, "damping must be >= 0"),
        ({"lr": -0.1}, "lr must be >= 0"),
        ({"kl_clip": 0.0}, "kl_clip must be > 0"),
        ({"damping": lambda k: float("nan")}, "damping must be"),
        ({"nonfinite": "ignore"}, "nonfinite must be"),
    ],
)
def test_bad_hyperparameters(kwargs: dict[str, Any], message: str) -> None:
    _, state, grads, caps = _setup()
    with pytest.raises(ValueError, match=message):
        kf.update(state, grads, captures=caps, **kwargs)


def test_missing_captures_and_bad_config() -> None:
    _, state, grads, _ = _setup()
    with pytest.raises(ValueError, match="captures="):
        kf.update(state, grads)
    with pytest.raises(ValueError, match="convention must be one of"):
        kf.init(state.layers and kf.register(nn.Linear(2, 2)), convention="other")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compute_method must be one of"):
        kf.init(kf.register(nn.Linear(2, 2)), compute_method="cholesky")
    with pytest.raises(ValueError, match="inv_dtype must be a floating"):
        kf.init(kf.register(nn.Linear(2, 2)), inv_dtype=torch.int32)


def test_no_warning_on_healthy_steps() -> None:
    _, state, grads, caps = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kf.update(state, grads, captures=caps)
