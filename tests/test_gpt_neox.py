"""`GPTNeoXKFACPreconditioner`'s checks (one process): DeepSpeed missing, a model that is
not a ``PipelineModule``, the inverse method, the experimental-feature warning."""

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
        pytest.raises(ValueError, match="PipelineModule, got an instance of Linear"),
    ):
        GPTNeoXKFACPreconditioner(nn.Linear(2, 2))


def test_inverse_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import kfac_func.parallel.gpt_neox as gn

    # stand in for PipelineModule: building a real one needs a DeepSpeed process group
    monkeypatch.setattr(gn, "_pipeline_module", lambda: nn.Linear)
    with (
        pytest.warns(ExperimentalFeatureWarning),
        pytest.raises(ValueError, match="inverse compute method is not supported"),
    ):
        GPTNeoXKFACPreconditioner(nn.Linear(2, 2), compute_method="inverse")
