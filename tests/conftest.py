"""Fixtures shared by the test modules.

``device``: the tests that take it run once per device, ``cpu`` always and ``cuda``
when a GPU is present. Without one the ``cuda`` cases are still collected (their ids
exist) and reported as skipped, so that a GPU machine runs exactly the same tests, and
``pytest -k cuda`` selects them there.
"""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a test runs on: ``cpu``, and ``cuda`` (skipped without a GPU)."""
    return torch.device(request.param)
