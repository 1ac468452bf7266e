"""The three preconditioner classes share one description of kfac-pytorch's arguments.

:meth:`kfac_func.adapter.arguments.KFACArguments._set_arguments` names, checks and stores
them; each constructor keeps an explicit signature and hands them over by name. These tests
hold the signatures to that description: every shared argument is accepted with
kfac-pytorch's default, but where a class documents another one, and the GPT-NeoX
preconditioner takes exactly the parallel preconditioner's arguments.
"""

from __future__ import annotations

import inspect

import pytest
from torch import nn

from kfac_func.adapter.arguments import KFACArguments, arguments_of
from kfac_func.adapter.preconditioner import KFACPreconditioner
from kfac_func.parallel.gpt_neox import GPTNeoXKFACPreconditioner
from kfac_func.parallel.layers import ColumnParallelLinear
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner

SHARED = [n for n in inspect.signature(KFACArguments._set_arguments).parameters if n != "self"]
# the defaults a class documents as other than KFACPreconditioner's
OTHER_DEFAULTS: dict[type, dict[str, object]] = {
    KFACPreconditioner: {},
    ParallelKFACPreconditioner: {"compute_eigenvalue_outer_product": False},
    GPTNeoXKFACPreconditioner: {"compute_eigenvalue_outer_product": False, "loss_divisor": None},
}


@pytest.mark.parametrize("cls", list(OTHER_DEFAULTS), ids=lambda c: c.__name__)
def test_each_constructor_takes_the_shared_arguments_with_their_defaults(cls: type) -> None:
    reference = inspect.signature(KFACPreconditioner).parameters
    params = inspect.signature(cls).parameters
    assert next(iter(params)) == "model"
    for name in SHARED:
        if name not in params:  # the model-parallel classes have no allreduce_method
            assert name == "allreduce_method" and cls is not KFACPreconditioner
            continue
        want = OTHER_DEFAULTS[cls].get(name, reference[name].default)
        assert params[name].default == want, (cls.__name__, name)
        if name != "model":
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_the_gpt_neox_constructor_takes_the_parallel_arguments() -> None:
    parallel = inspect.signature(ParallelKFACPreconditioner).parameters
    neox = inspect.signature(GPTNeoXKFACPreconditioner).parameters
    assert set(neox) == set(parallel)
    differ = {n for n in parallel if parallel[n].default != neox[n].default}
    assert differ == {"loss_divisor", "include_plain_linear"}


def test_a_constructor_hands_every_shared_argument_over() -> None:
    model = nn.Sequential(ColumnParallelLinear(4, 6), nn.Linear(6, 2))
    given = {"damping": 0.02, "factor_decay": 0.5, "kl_clip": None, "lr": 0.3}
    pre = ParallelKFACPreconditioner(
        model, **given, loss_reduction="sum", loss_divisor=2.0, skip_layers=["1"]
    )
    assert {k: getattr(pre, k) for k in given} == given
    assert (pre.loss_reduction, pre.loss_divisor, pre.skip_layers) == ("sum", 2.0, ["1"])
    assert list(pre.layers) == ["0"]


def test_arguments_of_takes_the_named_parameters_only() -> None:
    def build(model: object, *, damping: float = 0.1) -> None: ...

    given = {"self": object(), "model": "m", "damping": 0.5, "other": 1}
    assert arguments_of(build, given) == {"model": "m", "damping": 0.5}
