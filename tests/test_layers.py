"""Layer registration: kinds, shapes, skip_layers, unsupported modules, the table."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import kfac_func as kf


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bil = nn.Bilinear(8, 8, 4)
        self.act = nn.PReLU()
        self.proj = nn.Linear(8, 16, bias=False)
        self.conv = nn.Conv2d(4, 6, 3, padding="same", groups=2)
        self.attn = nn.MultiheadAttention(8, 2)
        self.head = nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 2))


def test_kinds_and_shapes() -> None:
    table = kf.register(Block())
    assert list(table) == [
        "proj",
        "conv",
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.out_proj",
        "head.0",
        "head.2",
    ]
    proj, conv = table["proj"], table["conv"]
    assert (proj.kind, proj.bias, proj.factor_shapes) == ("linear", None, ((8, 8), (16, 16)))
    assert conv.kind == "conv2d" and conv.groups == 2
    # per group: 2 input channels * 3*3 + bias = 19; 3 output channels
    assert conv.factor_shapes == ((2, 19, 19), (2, 3, 3))
    assert conv.matrix_shape == (2, 3, 19)
    assert conv.padding == (1, 1, 1, 1)
    assert table["head.0"].weight == "head.0.weight" and table["head.0"].bias == "head.0.bias"


def test_unsupported_modules_are_listed_not_fatal() -> None:
    table = kf.register(Block())
    assert "unsupported kind torch.nn.modules.linear.Bilinear" in table.skipped["bil"]
    assert "unsupported kind torch.nn.modules.activation.PReLU" in table.skipped["act"]
    # MultiheadAttention's projections are layers of the attention kind; its out_proj
    # child (never called) is one of them, not a Linear of its own
    assert table["attn.out_proj"].kind == "attention"
    assert not any(k.startswith("attn") for k in table.skipped)


def test_skip_layers_by_name_class_and_parent() -> None:
    model = Block()
    table = kf.register(model, skip_layers=["head", "Conv2d"])
    assert set(table) == {"proj"}  # "head" also matches MultiheadAttention
    assert table.skipped["head"] == "matched skip_layers 'head'"
    assert table.skipped["conv"] == "matched skip_layers 'Conv2d'"
    # children of a skipped parent are not listed separately
    assert not any(k.startswith("head.") for k in table.skipped)
    # a single string is accepted as one pattern
    assert set(kf.register(model, skip_layers="proj|conv")) == {
        "head.0",
        "head.2",
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.out_proj",
    }


def test_frozen_layers_are_skipped() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[0].weight.requires_grad_(False)
    table = kf.register(model)
    assert list(table) == ["1"]
    assert table.skipped["0"] == "weight does not require grad"


def test_table_prints_every_row() -> None:
    text = str(kf.register(Block(), skip_layers=["bil"]))
    lines = text.splitlines()
    assert lines[0].startswith("LayerTable(") and lines[0].endswith("skipped):"), lines[0]
    assert lines[1].split() == ["name", "kind", "A", "G", "note"]
    assert any(
        line.startswith("conv ") and "2x19x19" in line and "2 groups" in line for line in lines
    )
    assert any(line.startswith("bil ") and "skipped: matched skip_layers" in line for line in lines)
    assert any(
        line.startswith("act ") and "unsupported kind torch.nn.modules.activation.PReLU" in line
        for line in lines
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"kernel_size": 3, "padding": 1}, (1, 1, 1, 1)),
        ({"kernel_size": 3, "padding": (1, 2)}, (2, 2, 1, 1)),
        ({"kernel_size": 3, "padding": "valid"}, (0, 0, 0, 0)),
        ({"kernel_size": (4, 3), "padding": "same", "dilation": (1, 2)}, (2, 2, 1, 2)),
        ({"kernel_size": 2, "padding": "same"}, (0, 1, 0, 1)),
    ],
)
def test_conv_padding_matches_pytorch(kwargs: dict[str, object], expected: tuple[int, ...]) -> None:
    conv = nn.Conv2d(2, 2, **kwargs)  # type: ignore[arg-type]
    spec = kf.register(conv)[""]
    assert spec.padding == expected
    # PyTorch's own record of the padding it applies, in F.pad order
    assert tuple(conv._reversed_padding_repeated_twice) == expected


def test_weight_shape_and_spec_is_hashable() -> None:
    table = kf.register(nn.Sequential(nn.Conv2d(4, 8, (2, 3), groups=4), nn.Linear(5, 6)))
    assert table["0"].weight_shape == (8, 1, 2, 3)
    assert table["1"].weight_shape == (6, 5)
    assert len({table["0"], table["1"], table["0"]}) == 2


def test_root_module_can_be_a_layer() -> None:
    table = kf.register(nn.Linear(2, 3))
    assert list(table) == [""]
    assert table[""].weight == "weight"
    x = torch.randn(4, 2)
    model = nn.Linear(2, 3)
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.sum())
    assert set(grads) == {"weight", "bias"} and caps.layers[""].inputs[0] is not None


class _TiedLM(nn.Module):
    """A token embedding whose weight the output head reuses (as GPT-2 ties them)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def test_tied_embedding_and_head_are_one_layer_without_a_warning() -> None:
    model = _TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = kf.register(model)
        pre = kf.KFACPreconditioner(model)
    assert list(table) == ["mid", "head"] and not table.skipped
    assert table["head"].kind == "tied" and table["head"].weight == "emb.weight"
    # the preconditioner rewrites the shared gradient
    loss = model(torch.randint(0, 10, (3, 5))).sum()
    loss.backward()
    assert model.emb.weight.grad is not None
    before = model.emb.weight.grad.clone()
    pre.step()
    assert not torch.equal(model.emb.weight.grad, before)


class _TwoHeads(_TiedLM):
    """The tied pair plus a second head of the same weight: two heads, no tied layer."""

    def __init__(self) -> None:
        super().__init__()
        self.head2 = nn.Linear(4, 10, bias=False)
        self.head2.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(x)))
        return self.head(h) + self.head2(h.flip(-1))


def test_other_tied_parameters_are_skipped_with_a_warning_naming_both_layers() -> None:
    model = _TwoHeads()
    match = r"'emb.weight' is shared by layers \['emb', 'head', 'head2'\]"
    with pytest.warns(UserWarning, match=match):
        table = kf.register(model)
    assert list(table) == ["mid"]
    assert table.skipped["emb"] == "shares parameter 'emb.weight' with ['head', 'head2']"
    assert table.skipped["head"] == "shares parameter 'emb.weight' with ['emb', 'head2']"
    # the preconditioner leaves the shared gradient as the loss made it (and does not
    # warn again about the same model's parameter)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kf.KFACPreconditioner(model)
    loss = model(torch.randint(0, 10, (3, 5))).sum()
    loss.backward()
    assert model.emb.weight.grad is not None
    before = model.emb.weight.grad.clone()
    pre.step()
    assert torch.equal(model.emb.weight.grad, before)
