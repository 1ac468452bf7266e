"""Fixtures shared by the test modules.

``device``: the tests that take it run once per device, ``cpu`` always and ``cuda``
when a GPU is present. Without one the ``cuda`` cases are still collected (their ids
exist) and reported as skipped, so that a GPU machine runs exactly the same tests, and
``pytest -k cuda`` selects them there.
"""

from __future__ import annotations

import pytest
import torch

NUMERICS = {
    "test_attention",
    "test_basis_moments",
    "test_blocked_factors",
    "test_blocks",
    "test_broadcast_positions",
    "test_capture",
    "test_capture_outputs",
    "test_checkpointing_activations",
    "test_compile_steps",
    "test_consistency",
    "test_conv",
    "test_conv1d",
    "test_decomposition",
    "test_diagonal",
    "test_ekfac",
    "test_embedding",
    "test_gram_precision",
    "test_grouped",
    "test_host_syncs",
    "test_kfac_approx",
    "test_loss_divisor",
    "test_norms",
    "test_oracle_linear",
    "test_real_models",
    "test_recorded_embedding",
    "test_scaled_embedding",
    "test_step_options",
    "test_sync_free",
    "test_tied",
    "test_transposed_linear",
    "test_update",
}
"""The modules marked ``numerics``: they compare two computations of one quantity (grouped
and per layer, sync-free and checked, compiled and eager, with and without activation
checkpointing) or a computation and an oracle, at tolerances set by rounding. CI runs them
again under other CPU kernels (``ATEN_CPU_CAPABILITY=avx2`` with
``MKL_ENABLE_INSTRUCTIONS=AVX2``, then ``default`` with ``SSE4_2``), so that a tolerance
that holds by the accident of one CPU's rounding fails there, not on a user's machine (see
``tests/numerics.py``)."""

CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA)),
]


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the tests that take ``device`` over :data:`DEVICES`, after their own
    parameters: ids read ``test_x[<their ids>-cpu]``, the ids of before plus ``-cpu``."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of the :data:`NUMERICS` modules ``numerics``."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in NUMERICS:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a test runs on: ``cpu``, and ``cuda`` (skipped without a GPU)."""
    return torch.device(request.param)
