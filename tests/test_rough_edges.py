"""Error messages that name what the user passed, explicit damping in
``precondition_grads``, and benchmark outputs that leave the committed results alone."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf
from kfac_func import KFACPreconditioner

ROOT = Path(__file__).resolve().parents[1]
F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


def _setup(**init: Any) -> tuple[kf.KFACState, dict[str, torch.Tensor], kf.Captures]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 4, (8,))
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    return kf.init(kf.register(model), **{**F64, **init}), grads, caps


# --------------------------------------------------------------- nothing to precondition


def test_empty_model_same_error_functional_and_adapter() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Embedding(4, 3))
    table = kf.register(model, skip_layers=["Embedding"])
    # register still returns a printable table
    assert not table and "skipped: matched skip_layers 'Embedding'" in str(table)
    with pytest.raises(ValueError) as functional:
        kf.init(table)
    with pytest.raises(ValueError) as adapter:
        KFACPreconditioner(model, skip_layers=["Embedding"])
    assert str(functional.value) == str(adapter.value)
    message = str(functional.value)
    assert message.startswith("no layer of Sequential can be preconditioned")
    assert "skipped: matched skip_layers 'Embedding'" in message  # the table


def test_empty_mapping_is_refused_unless_allowed() -> None:
    with pytest.raises(ValueError, match="no layer of the model can be preconditioned"):
        kf.init({})
    assert kf.init({}, allow_empty=True).layers == {}


# --------------------------------------------------------------- messages naming arguments


def test_scaling_is_named() -> None:
    with pytest.raises(ValueError, match=r"scaling must be one of \('fisher', 'kfac-pytorch'\)"):
        KFACPreconditioner(nn.Linear(2, 2), settings=kf.Settings(scaling="bogus"))


@pytest.mark.parametrize("name", ["damping", "lr", "factor_decay", "kl_clip"])
def test_non_numbers_are_named(name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be a number .*got 'abc' of type str"):
        KFACPreconditioner(nn.Linear(2, 2), **{name: "abc"})


def test_functional_damping_not_a_number() -> None:
    state, grads, caps = _setup()
    with pytest.raises(TypeError, match="damping must be a number, got 'abc'"):
        kf.update(state, grads, captures=caps, damping="abc")  # type: ignore[arg-type]


def test_grads_must_be_a_mapping() -> None:
    state, _, caps = _setup()
    match = "grads must be a mapping of parameter name -> gradient tensor.*got NoneType"
    with pytest.raises(TypeError, match=match):
        kf.update(state, None, captures=caps)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match):
        kf.step.precondition_grads(state, None)  # type: ignore[arg-type]


# --------------------------------------------------------------- explicit damping


def _decomposed(**init: Any) -> tuple[kf.KFACState, dict[str, torch.Tensor]]:
    state, grads, caps = _setup(**init)
    state = kf.decompose(kf.step.accumulate_factors(state, caps), damping=1e-1)
    return state, grads


def test_explicit_damping_applies_to_precomputed_outer_product() -> None:
    """With ``dgda`` (made at damping 0.1), an explicit damping of 1.0 gives what a
    decomposition without ``dgda`` gives at 1.0, without a warning."""
    with_outer, grads = _decomposed(compute_eigenvalue_outer_product=True)
    without, _ = _decomposed(compute_eigenvalue_outer_product=False)
    assert with_outer.layers["0"].decomposition.dgda is not None  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kf.step.precondition_grads(with_outer, grads, damping=1.0, kl_clip=None)
        want = kf.step.precondition_grads(without, grads, damping=1.0, kl_clip=None)
        stale = kf.step.precondition_grads(with_outer, grads, kl_clip=None)  # dgda's own
        same = kf.step.precondition_grads(without, grads, damping=0.1, kl_clip=None)
    for name in grads:
        torch.testing.assert_close(got[name], want[name])
        torch.testing.assert_close(stale[name], same[name])
    assert not torch.allclose(got["0.weight"], stale["0.weight"])


def test_explicit_damping_warns_for_inverses() -> None:
    state, grads = _decomposed(compute_method="inverse")
    with pytest.warns(UserWarning, match=r"damping=1\.0.*layers \['0', '2'\].*decompose again"):
        out = kf.step.precondition_grads(state, grads, damping=1.0, kl_clip=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = kf.step.precondition_grads(state, grads, kl_clip=None)  # not given: no warning
    for name in grads:
        torch.testing.assert_close(out[name], default[name])


def test_update_does_not_warn_about_damping() -> None:
    for init in ({"compute_method": "inverse"}, {"compute_eigenvalue_outer_product": True}):
        state, grads, caps = _setup(**init)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                _, state = kf.update(state, grads, captures=caps, damping=0.5)


# --------------------------------------------------------------- benchmark outputs


def _load(script: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{script}", ROOT / "benchmarks" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def _ignored(path: Path) -> bool:
    proc = subprocess.run(
        ["git", "check-ignore", "-q", str(path)], cwd=ROOT, capture_output=True, check=False
    )
    return proc.returncode == 0


def test_benchmarks_write_untracked_outputs_by_default() -> None:
    optimizers = _load("optimizers.py")
    out = Path(optimizers.parse_args([]).out)
    assert out == ROOT / "benchmarks" / "out" / "optimizers"
    explicit = optimizers.parse_args(["--out", "benchmarks/results/optimizers"]).out
    assert explicit == "benchmarks/results/optimizers"
    source = (ROOT / "benchmarks" / "convergence.py").read_text()
    assert 'ROOT / "benchmarks" / "out" / "convergence"' in source
    assert '"results" / "convergence"' not in source
    for name in ("convergence", "optimizers"):
        assert _ignored(ROOT / "benchmarks" / "out" / f"{name}.csv")
        assert _ignored(ROOT / "benchmarks" / "out" / f"{name}_lm.png")
        assert not _ignored(ROOT / "benchmarks" / "results" / f"{name}.csv")


def _token_model_step(
    scaling: str,
    tokens: int,
    damping: float,
    dtype: torch.dtype = torch.float32,
    steps: int = 32,
    **kwargs: Any,
) -> list[str]:
    """Adapter steps on a per-token model whose loss is the mean over every token, with
    ``factor_decay=0.5``: the identity the "kfac-pytorch" factors start from weighs
    ``0.5 ** k`` after ``k`` steps, next to the data's A ≈ 0.3–1 and G ≈ 1.5e-7 (measured):
    the mean curvature is ≈ 1.5e-5 at the 16th step (above 1e-3 / 100: no warning) and
    ≈ 4e-8 at the 32nd (the damping dominates: the warning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    pre = kf.KFACPreconditioner(
        model,
        damping=damping,
        kl_clip=None,
        factor_dtype=dtype,
        factor_decay=0.5,
        lr=0.0,
        **with_settings(settings=kf.Settings(scaling=scaling), **kwargs),
    )
    x = torch.randn(4, tokens, 8)
    y = torch.randint(0, 5, (4, tokens))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):  # warned once at most: later steps say nothing
            model.zero_grad()
            F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1)).backward()
            pre.step()
    return [str(w.message) for w in seen if "curvature" in str(w.message)]


def test_damping_that_drowns_the_factors_warns_once_naming_the_fix() -> None:
    # kfac-pytorch's scaling on a loss averaged over 4 x 256 tokens: G ~ 1 / rows^2
    messages = _token_model_step("kfac-pytorch", 256, 1e-3)
    assert len(messages) == 1, messages
    assert "scaling='fisher'" in messages[0] and "layer '" in messages[0]
    # the same model and batch in the Fisher convention: curvature comparable to damping
    assert _token_model_step("fisher", 256, 1e-3) == []
    # a damping below the curvature: nothing to say (float64 factors: in float32 the
    # batch part, ~1e-7, is below the resolution of the identity the factors start from)
    assert _token_model_step("kfac-pytorch", 256, 1e-12, torch.float64) == []
    assert len(_token_model_step("kfac-pytorch", 256, 1e-3, torch.float64)) == 1


def test_damping_warning_waits_until_the_identity_start_has_decayed() -> None:
    """Early "kfac-pytorch" factors are mostly the identity they start from, which (not the
    damping) sets the step: no warning then, though the batch factors are tiny."""
    assert _token_model_step("kfac-pytorch", 256, 1e-3, steps=31) == []
    assert len(_token_model_step("kfac-pytorch", 256, 1e-3, steps=32)) == 1


def test_no_damping_warning_where_the_damping_does_not_set_the_step() -> None:
    """With eigenbasis moments the step divides by the running moments, not by the
    damping: nothing to warn about, whatever the damping."""
    for scaling in ("kfac-pytorch", "fisher"):
        assert _token_model_step(scaling, 256, 10.0, eigenbasis_moments=True) == []


def test_inverse_method_judges_each_side() -> None:
    """The inverse method adds the damping to A and to G separately: it drowns the step
    only when it exceeds both sides' curvature (here A's mean eigenvalue is ~1, G's tiny,
    their product tiny: the eigen method's criterion would warn)."""
    assert len(_token_model_step("kfac-pytorch", 256, 1e-3)) == 1
    assert _token_model_step("kfac-pytorch", 256, 1e-3, compute_method="inverse") == []
    assert len(_token_model_step("kfac-pytorch", 256, 1e3, compute_method="inverse")) == 1


def test_damping_dominance_matches_the_mean_eigenvalue_of_the_kronecker_product() -> None:
    from kfac_func.step.diagnostics import DOMINANCE, damping_dominance

    torch.manual_seed(1)
    state = kf.init(kf.register(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))))
    layers = {}
    for name, layer in state.layers.items():
        n, m = layer.a_factor.shape[-1], layer.g_factor.shape[-1]
        a, g = torch.randn(n, n), torch.randn(m, m)
        layers[name] = layer.replace(a_factor=a @ a.T, g_factor=g @ g.T, factor_updates=1)
    means = {
        name: torch.linalg.eigvalsh(torch.kron(s.a_factor, s.g_factor)).mean().item()
        for name, s in layers.items()
    }
    top = max(means, key=means.__getitem__)
    state = state.replace(layers=layers)
    found = damping_dominance(state, DOMINANCE * means[top] * 1.01)
    assert found is not None and found[0] == top
    assert found[1] == pytest.approx(means[top], rel=1e-5)
    assert damping_dominance(state, DOMINANCE * means[top] * 0.99) is None


@pytest.mark.parametrize("method", ["eigen", "ekfac"])
def test_forward_without_backward_is_not_a_micro_batch(method: str) -> None:
    """A loss evaluated in training mode with gradients enabled and never backpropagated
    leaves the step as it would be without it."""
    results = []
    for evaluate in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        pre = KFACPreconditioner(
            model, compute_method=method, settings=kf.Settings(scaling="fisher"), kl_clip=None
        )
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        for step in range(3):
            if evaluate:
                F.cross_entropy(model(torch.randn(5, 6)), y[:5])  # no backward
            model.zero_grad()
            F.cross_entropy(model(x + step), y).backward()
            pre.step()
        results.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_factors_follow_the_batch_device_at_the_first_update_only() -> None:
    """A state built without ``device=`` takes its starting factors to the batch's device;
    later, factors on another device than the batch's are an error naming the layer."""
    from kfac_func.state import KFACConfig
    from kfac_func.step.accumulate import fold_factors

    state = kf.init(kf.register(nn.Sequential(nn.Linear(3, 2))))
    ls = state.layers["0"]
    a = torch.ones(4, 4, device="meta")
    g = torch.ones(2, 2, device="meta")
    for convention in ("kfac-pytorch", "fisher"):
        new = fold_factors(ls, a, g, 0.9, KFACConfig(convention=convention))  # type: ignore[arg-type]
        assert new.a_factor.device.type == "meta" and new.g_factor.device.type == "meta"
    with pytest.raises(ValueError, match=r"layer '0'.*cpu.*meta"):
        fold_factors(ls.replace(factor_updates=1), a, g, 0.9, KFACConfig())


def test_a_default_preconditioner_on_an_mlp_classifier_does_not_warn() -> None:
    """kfac-pytorch's defaults on a small classifier: the factors start at the identity,
    which sets the early steps; the damping is judged only against the running factors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
    pre = kf.KFACPreconditioner(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(20):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            optimizer.step()
    assert [str(w.message) for w in seen if "curvature" in str(w.message)] == []
