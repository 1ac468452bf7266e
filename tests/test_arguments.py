"""The three preconditioner classes share one description of kfac-pytorch's arguments.

:class:`kfac_func.adapter.arguments.SharedArguments` names and types them,
:data:`~kfac_func.adapter.arguments.KFAC_PYTORCH_DEFAULTS` gives their defaults; each
constructor takes them as ``**shared`` and shows them in its signature. These tests hold
the signatures to that description: every shared argument is accepted with kfac-pytorch's
default, but where a class documents another one, a misspelt keyword is refused as Python
refuses it, and the GPT-NeoX preconditioner takes exactly the parallel preconditioner's
arguments.
"""

from __future__ import annotations

import inspect

import pytest
from torch import nn

from kfac_func import Settings
from kfac_func.adapter.arguments import KFAC_PYTORCH_DEFAULTS, SharedArguments
from kfac_func.adapter.preconditioner import KFACPreconditioner
from kfac_func.parallel.gpt_neox import GPTNeoXKFACPreconditioner
from kfac_func.parallel.layers import ColumnParallelLinear
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner

SHARED = ["model", *SharedArguments.__annotations__]
# the defaults a class documents as other than KFACPreconditioner's
OTHER_DEFAULTS: dict[type, dict[str, object]] = {
    KFACPreconditioner: {},
    ParallelKFACPreconditioner: {"compute_eigenvalue_outer_product": False},
    GPTNeoXKFACPreconditioner: {"compute_eigenvalue_outer_product": False},
}


@pytest.mark.parametrize("cls", list(OTHER_DEFAULTS), ids=lambda c: c.__name__)
def test_each_constructor_takes_the_shared_arguments_with_their_defaults(cls: type) -> None:
    reference = inspect.signature(KFACPreconditioner).parameters
    params = inspect.signature(cls).parameters
    assert next(iter(params)) == "model"
    for name in SHARED:
        want = OTHER_DEFAULTS[cls].get(name, reference[name].default)
        assert params[name].default == want, (cls.__name__, name)
        if name != "model":
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_the_gpt_neox_constructor_takes_the_parallel_arguments() -> None:
    parallel = inspect.signature(ParallelKFACPreconditioner).parameters
    neox = inspect.signature(GPTNeoXKFACPreconditioner).parameters
    assert set(neox) == set(parallel)
    differ = {n for n in parallel if parallel[n].default != neox[n].default}
    assert differ == {"include_plain_linear"}  # and the settings' loss_divisor (see its docs)


def test_a_constructor_hands_every_shared_argument_over() -> None:
    model = nn.Sequential(ColumnParallelLinear(4, 6), nn.Linear(6, 2))
    given = {"damping": 0.02, "factor_decay": 0.5, "kl_clip": None, "lr": 0.3}
    pre = ParallelKFACPreconditioner(
        model, **given, settings=Settings(loss_reduction="sum", loss_divisor=2.0), skip_layers=["1"]
    )
    assert {k: getattr(pre, k) for k in given} == given
    assert (pre.loss_reduction, pre.loss_divisor, pre.skip_layers) == ("sum", 2.0, ["1"])
    assert list(pre.layers) == ["0"]


def test_every_shared_argument_has_a_default() -> None:
    assert list(KFAC_PYTORCH_DEFAULTS) == list(SharedArguments.__annotations__)


@pytest.mark.parametrize(
    "cls", [KFACPreconditioner, ParallelKFACPreconditioner], ids=lambda c: c.__name__
)
def test_a_misspelt_keyword_is_refused_naming_the_class(cls: type) -> None:
    model = nn.Sequential(ColumnParallelLinear(4, 6), nn.Linear(6, 2))
    refused = rf"{cls.__name__}\(\) got an unexpected keyword argument 'dampnig'"
    with pytest.raises(TypeError, match=refused):
        cls(model, dampnig=0.1)
