"""The test extra installs beside the CPU torch: transformers' GPT-2 imports, and
torchvision (which BackPACK, a dependency of the curvlinops oracle, requires and whose
CUDA-built wheels break beside a CPU torch) is either absent or importable with its ops."""

from __future__ import annotations

import importlib.util

import torch


def test_transformers_gpt2_and_curvlinops_import_and_torchvision_absent_or_working() -> None:
    import curvlinops  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11))
    assert model(torch.zeros(1, 3, dtype=torch.long)).logits.shape == (1, 3, 11)
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision

        boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
        kept = torchvision.ops.nms(boxes, torch.tensor([1.0, 0.5]), 0.5)
        assert kept.tolist() == [0]
