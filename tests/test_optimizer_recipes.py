"""The recipes of `kf.KFAC`: ``kf.KFAC(model)`` is the recommended recipe, kfac-pytorch's
is ``recipe="kfac-pytorch"`` (equal step for step to what ``kf.KFAC(model)`` was before),
the decoupled weight decay is AdamW's, bad arguments are named, and ``print(opt)`` shows
the layers."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import kfac_func as kf
from kfac_func.adapter.recipes import HEAD_NAMES

F64 = torch.float64


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(16, 8), nn.Flatten(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)
    ).to(F64)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 16, (24, 4), generator=g)
        out.append((x, x.sum(1) % 5))
    return out


def _train_face(model: nn.Module, opt: kf.KFAC, steps: int = 6) -> list[torch.Tensor]:
    for x, y in _batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_parts(
    model: nn.Module, pre: kf.KFACPreconditioner, opts: list[torch.optim.Optimizer]
) -> list[torch.Tensor]:
    for x, y in _batches(6):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        for o in opts:
            o.step()
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"parameter {i}: max difference {(x - y).abs().max()}"


def test_the_kfac_pytorch_recipe_is_the_old_default_step_for_step() -> None:
    """``recipe="kfac-pytorch"`` with nothing else equals what ``kf.KFAC(model)`` built
    before the recommended recipe: kfac-pytorch's preconditioner defaults with the
    learning rate 0.001 (the KL clip's too), plain SGD, AdamW with torch's defaults."""
    model = _model()
    manual = copy.deepcopy(model)
    opt = kf.KFAC(model, recipe="kfac-pytorch", skip_layers=["Embedding"])
    pre = kf.KFACPreconditioner(manual, lr=1e-3, skip_layers=["Embedding"])
    mine, rest = pre.layers.split_parameters(manual)
    opts = [torch.optim.SGD(mine, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]
    assert opt.preconditioner.kl_clip == 1e-3 and opt.preconditioner.scaling == "kfac-pytorch"
    _equal(_train_face(model, opt), _train_parts(manual, pre, opts))


RECOMMENDED: dict[str, Any] = {
    "eigenbasis_moments": True,
    "moment_beta1": 0.9,
    "moment_beta2": 0.95,
    "kl_clip": None,
    "scaling": "fisher",
    "factor_update_steps": kf.step.GrowingInterval(first=1, until=256, most=4),
    "inv_update_steps": kf.step.GrowingInterval(),
    "factor_decay": kf.step.DecayPerStep(0.9, kf.step.GrowingInterval(first=1, until=256, most=4)),
    "batched_eigh": True,
    "orthogonal": kf.Orthogonal(powers=(0.5, 0.0), wider_than=512, block=512),
}
FIELDS = {f.name for f in dataclasses.fields(kf.Settings)}
ARGUMENTS = {k: v for k, v in RECOMMENDED.items() if k not in FIELDS}
"""The recipe's kfac-pytorch arguments; its other settings are :data:`SETTINGS`'."""
SETTINGS = kf.Settings(**{k: v for k, v in RECOMMENDED.items() if k in FIELDS})


def test_the_default_is_the_recommended_recipe_step_for_step() -> None:
    """``kf.KFAC(model)`` equals the race's ``kfac-moments-wide`` written out: its nine
    preconditioner arguments, SGD without momentum, AdamW with the same learning rate,
    betas and no weight decay on the others."""
    model = _model()
    manual = copy.deepcopy(model)
    opt = kf.KFAC(model, skip_layers=["Embedding"])
    pre = kf.KFACPreconditioner(
        manual, lr=0.014, skip_layers=["Embedding"], settings=SETTINGS, **ARGUMENTS
    )
    mine, rest = pre.layers.split_parameters(manual)
    opts = [
        torch.optim.SGD(mine, lr=0.014, momentum=0.0),
        torch.optim.AdamW(rest, lr=0.014, betas=(0.9, 0.95), weight_decay=0.0),
    ]
    assert opt.recipe is kf.RECIPES["recommended"]
    assert opt.param_groups[0]["lr"] == kf.RECIPES["recommended"].lr == 0.014
    _equal(_train_face(model, opt), _train_parts(manual, pre, opts))


def test_the_same_recipe_written_out_through_the_kfac_pytorch_preset() -> None:
    """Everything the recommended recipe sets can be set one by one on the other recipe."""
    a, b = _model(), _model()
    one = kf.KFAC(a)
    other = kf.KFAC(
        b,
        lr=0.014,
        recipe="kfac-pytorch",
        betas=(0.9, 0.95),
        weight_decay=0.0,
        base_kwargs={"momentum": 0.0},
        **RECOMMENDED,
    )
    _equal(_train_face(a, one), _train_face(b, other))


def test_the_default_steps_the_wide_layers_orthogonally_and_the_rest_in_the_eigenbasis() -> None:
    """On a model with a layer whose input is wider than 512, ``kf.KFAC(model)`` gives that
    layer Muon's step on K-FAC's input curvature (it keeps ``ortho_momentum``, its G
    factor diagonal) and the narrow layer Adam's step in its eigenbasis, equal to the
    recipe written out (its iteration in bfloat16 where the CPU multiplies it natively)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(520, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    manual = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(16, 520, generator=g, dtype=F64), torch.randint(0, 3, (16,), generator=g))
        for _ in range(4)
    ]

    def train(m: nn.Module, step: Any) -> list[torch.Tensor]:
        for x, y in batches:
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            step()
        return [p.detach().clone() for p in m.parameters()]

    from kfac_func.adapter.optimizer import _native_bf16

    opt = kf.KFAC(model)
    # the face runs the iteration in bfloat16 where the CPU multiplies it natively
    native = torch.bfloat16 if _native_bf16(model) else None
    ortho = RECOMMENDED["orthogonal"]._replace(dtype=native)
    assert opt.preconditioner.orthogonal == ortho
    pre = kf.KFACPreconditioner(
        manual, lr=0.014, settings=SETTINGS.replace(orthogonal=ortho), **ARGUMENTS
    )
    sgd = torch.optim.SGD(manual.parameters(), lr=0.014, momentum=0.0)
    _equal(train(model, opt.step), train(manual, lambda: (pre.step(), sgd.step())))
    wide, narrow = (opt.preconditioner.state.layers[n] for n in ("0", "2"))
    assert wide.ortho_momentum is not None and wide.g_factor.dim() == 1
    assert narrow.ortho_momentum is None and narrow.basis_moment is not None


@pytest.mark.parametrize(
    ("base", "others"),
    [
        (torch.optim.SGD, torch.optim.AdamW),
        (torch.optim.SGD, torch.optim.SGD),
        (torch.optim.AdamW, torch.optim.AdamW),
    ],
)
def test_weight_decay_is_decoupled_on_every_parameter(base: Any, others: Any) -> None:
    """One step with ``weight_decay=wd`` moves every parameter by ``-lr·wd·p`` more than
    the same step without, once: AdamW decays its parameters itself (``weight_decay``
    passed to it), the face decays those of any other base optimizer."""
    lr, wd = 0.01, 0.3
    a, b = _model(), _model()
    start = [p.detach().clone() for p in a.parameters()]
    kwargs = {"lr": lr, "skip_layers": ["Embedding"], "base": base, "others": others}
    with_decay = kf.KFAC(a, weight_decay=wd, **kwargs)
    without = kf.KFAC(b, weight_decay=0.0, **kwargs)
    if others is torch.optim.AdamW:
        assert with_decay.others_optimizer is not None
        group = with_decay.others_optimizer.param_groups[0]
        assert group["weight_decay"] == wd and group["betas"] == (0.9, 0.95)
    decayed = _train_face(a, with_decay, steps=1)
    plain = _train_face(b, without, steps=1)
    for i, (p, q, p0) in enumerate(zip(decayed, plain, start)):
        torch.testing.assert_close(p, q - lr * wd * p0, msg=f"parameter {i}")


def test_the_automatic_switches_and_their_absence_in_the_preset() -> None:
    """The recommended recipe batches the decompositions and, off CUDA, stays
    synchronising; kfac-pytorch's recipe chooses nothing; an argument given wins."""
    pre = kf.KFAC(_model()).preconditioner
    assert pre.batched_eigh and pre.grouped is None and not pre.sync_free  # grouped off the CPU
    assert not kf.KFAC(_model(), recipe="kfac-pytorch").preconditioner.batched_eigh
    assert not kf.KFAC(_model(), batched_eigh=False).preconditioner.batched_eigh


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recipe": "fast"}, "recipe must be one of"),
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"betas": (0.9, 1.0)}, "betas must be two numbers"),
        ({"betas": (0.8, 0.9), "moment_beta2": 0.99}, "betas=.* and moment_beta2=0.99"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kf.KFAC(_model(), **kwargs)


def test_print_shows_the_recipe_and_the_layer_table() -> None:
    opt = kf.KFAC(_model(), skip_layers=["Embedding"])
    head, step, when, where, table = repr(opt).split("\n", 4)
    assert head == "KFAC(recipe='recommended', lr=0.014, current lr=0.014)"
    assert step.startswith("  step: ")
    assert when == (
        "  schedule: statistics every step, twice as far apart each time the run doubles from "
        "step 256, at most every 4; decompositions every 2 steps, twice as far apart each "
        "time the run doubles from step 256, at most every 32"
    )
    assert where == (
        "  K-FAC preconditions 2 layers: SGD on their 4 parameters; AdamW on 1 other parameter"
    )
    assert table == str(opt.preconditioner.layers)
    assert "skipped: matched skip_layers 'Embedding'" in table


def _step_words(opt: kf.KFAC) -> str:
    line = repr(opt).splitlines()[1]
    assert line.startswith("  step: "), line
    return line.removeprefix("  step: ")


def test_print_names_the_recommended_step() -> None:
    """Adam's step in the eigenbasis on the narrow layers, Muon's on the wide ones: none
    of them on a narrow model, the one 600 wide on a model that has it."""
    assert _step_words(kf.KFAC(_model())) == (
        "Adam's step in K-FAC's eigenbasis (betas 0.9, 0.95) on 3 layers; Muon's step on "
        "K-FAC's input curvature (A^(-1/2)) on the layers with a factor side wider than 512, "
        "A in blocks of at most 512: none here"
    )
    wide = nn.Sequential(nn.Linear(600, 16), nn.Tanh(), nn.Linear(16, 5))
    words = _step_words(kf.KFAC(wide))
    assert words.startswith("Adam's step in K-FAC's eigenbasis (betas 0.9, 0.95) on 1 layer;")
    assert words.endswith("A in blocks of at most 512: 1 layer here")
    wide = nn.Sequential(nn.Linear(600, 16), nn.Tanh(), nn.Linear(16, 600))
    words = _step_words(kf.KFAC(wide))
    assert words.startswith("Adam's step in K-FAC's eigenbasis (betas 0.9, 0.95) on no layer here;")
    assert words.endswith("A in blocks of at most 512: 2 layers here")


def test_print_names_kfac_pytorchs_step() -> None:
    opt = kf.KFAC(_model(), recipe="kfac-pytorch")
    assert _step_words(opt) == (
        "K-FAC's damped inverse (eigendecomposition, damping 0.001) with the KL clip 0.001"
    )
    assert repr(opt).splitlines()[0] == "KFAC(recipe='kfac-pytorch', lr=0.001, current lr=0.001)"


ONE_SIDED = kf.Orthogonal(powers=(0.5, 0.0), skip=HEAD_NAMES)
"""The two-sided recipe made one-sided (what the retired recipe ``"orthogonal"`` was)."""


@pytest.mark.parametrize(
    ("face", "words"),
    [
        (
            {"orthogonal": ONE_SIDED},
            "Muon's step on K-FAC's input curvature (A^(-1/2)) on every layer",
        ),
        (
            {},
            "Muon's step on K-FAC's curvature, both sides (G^(-1/4) · A^(-1/4)) on every layer",
        ),
    ],
)
def test_print_names_the_orthogonal_step(face: dict[str, Any], words: str) -> None:
    """Muon's step on the hidden layers, the head (named ``head``) left to AdamW."""
    model = _model()
    model.add_module("head", nn.Linear(5, 5).to(F64))
    opt = kf.KFAC(model, recipe="orthogonal-two-sided", **face)
    text = _step_words(opt)
    assert text == (
        f"{words} of one weight matrix but the head (named lm_head, head, classifier or "
        "output): 2 layers here"
    )
    assert "AdamW on 3 other parameters" in repr(opt)  # the embedding, the head's two


def test_print_follows_the_settings_not_the_recipe_name() -> None:
    """The words are read from the preconditioner: arguments that replace the recipe's
    change them."""
    opt = kf.KFAC(_model(), compute_method="inverse", eigenbasis_moments=False, orthogonal=None)
    assert _step_words(opt) == "K-FAC's damped inverse (explicit inverses, damping 0.001)"
    opt = kf.KFAC(_model(), recipe="kfac-pytorch", kl_clip=0.01)
    assert _step_words(opt) == (
        "K-FAC's damped inverse (eigendecomposition, damping 0.001) with the KL clip 0.01"
    )
    opt = kf.KFAC(_model(), recipe="kfac-pytorch", damping=lambda step: 0.1)
    assert _step_words(opt).startswith("K-FAC's damped inverse (eigendecomposition, damping (sc")
    opt = kf.KFAC(_model(), orthogonal=kf.Orthogonal(wider_than=20))  # only 33x33 is wider
    assert _step_words(opt) == (
        "Adam's step in K-FAC's eigenbasis (betas 0.9, 0.95) on 2 layers; Muon's step on "
        "K-FAC's input curvature (A^(-1/2)) on the layers with a factor side wider than 20: "
        "1 layer here"
    )


def test_print_shows_the_built_and_the_current_learning_rate() -> None:
    """A schedule that decays the learning rate to 0 (as Hugging Face's linear one does)
    leaves the learning rate the optimizer was built with on show."""
    opt = kf.KFAC(_model(), lr=0.03)
    opt.param_groups[0]["lr"] = 0.0
    assert repr(opt).splitlines()[0] == "KFAC(recipe='recommended', lr=0.03, current lr=0)"
    assert opt.built_lr == 0.03


def test_the_table_starts_on_its_own_line() -> None:
    """``print(pre.steps, pre.layers)``: the count, then the table's title, then its
    header on a line of its own."""
    pre = kf.KFACPreconditioner(_model())
    first, second = f"{pre.steps} {pre.layers}".splitlines()[:2]
    assert first == "0 LayerTable(3 layers, 0 skipped):"
    assert second.split()[:2] == ["name", "kind"]


def test_sync_free_is_chosen_for_one_cuda_process_only() -> None:
    """The switch the recommended recipe turns on for CUDA models (no GPU here: a module
    whose parameters say they are on CUDA stands in)."""
    from types import SimpleNamespace

    from kfac_func.adapter.optimizer import _one_cuda_process

    class OnCuda(nn.Module):
        def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
            return iter([SimpleNamespace(is_cuda=True)])

    assert _one_cuda_process(OnCuda())
    assert not _one_cuda_process(_model())
