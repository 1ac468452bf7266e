"""`GPTNeoXKFACPreconditioner`'s checks (one process): DeepSpeed missing, a model that is
not a ``PipelineModule``, the inverse method, a negative bucket cap, the
experimental-feature warning; the messages begin with kfac-pytorch's words."""

from __future__ import annotations

import sys

import pytest
from torch import nn

from kfac_func.parallel.gpt_neox import ExperimentalFeatureWarning, GPTNeoXKFACPreconditioner


def test_without_deepspeed_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # a None entry in sys.modules makes the import fail as if DeepSpeed were absent
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.pipe", None)
    with pytest.raises(ImportError, match=r"pip install \"kfac_func\[deepspeed\]\""):
        GPTNeoXKFACPreconditioner(nn.Linear(2, 2))


@pytest.mark.slow
def test_model_must_be_a_pipeline_module() -> None:
    pytest.importorskip("deepspeed")
    with (
        pytest.warns(ExperimentalFeatureWarning, match="experimental"),
        pytest.raises(
            ValueError,
            match=r"^model must be an instance of deepspeed\.pipe\.PipelineModule\. Got an "
            r"instance of <class 'torch\.nn\.modules\.linear\.Linear'>\.$",
        ),
    ):
        GPTNeoXKFACPreconditioner(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # kfac-pytorch's messages begin these, case included (its tests match 'Inverse')
        (dict(compute_method="inverse"), r"^Inverse method not supported with GPT NeoX\. "),
        (dict(allreduce_bucket_cap_mb=-1), r"^allreduce_bucket_cap_mb must be >= 0, got -1"),
        (dict(compute_method="ekfac"), r"^compute_method='ekfac' is not supported with GPT NeoX"),
    ],
)
def test_arguments_are_refused_in_kfac_pytorchs_words(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], message: str
) -> None:
    import kfac_func.parallel.gpt_neox as gn

    # stand in for PipelineModule: building a real one needs a DeepSpeed process group
    monkeypatch.setattr(gn, "_pipeline_module", lambda: nn.Linear)
    with (
        pytest.warns(
            ExperimentalFeatureWarning, match=r"^KFAC support for GPT-NeoX training is experimental"
        ),
        pytest.raises(ValueError, match=message),
    ):
        GPTNeoXKFACPreconditioner(nn.Linear(2, 2), **kwargs)  # type: ignore[arg-type]
