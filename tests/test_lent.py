"""State dicts that lend a live state's tensors (``kfac_func/checkpoint/lent.py``): a DCP
template gets fresh tensors for the lent ones and keeps every other tensor, plain or
DTensor (FSDP2's parameters, whose wrapper has no storage of its own)."""

from __future__ import annotations

from pathlib import Path

import torch
from gloo import gloo_group, record_errors, spawn

from kfac_func.checkpoint.lent import fresh_template, lend


def test_lent_tensors_and_their_views_are_replaced_the_others_kept() -> None:
    state = {"A": torch.eye(3), "moments": [torch.ones(2, 2)], "empty": torch.zeros(0)}
    sd = lend({"optim": state})
    moment = state["moments"][0]
    weight = torch.randn(4)
    template = fresh_template({"model": {"w": weight}, "optim": dict(sd["optim"])})
    assert template["model"]["w"] is weight
    assert template["optim"]["A"] is not state["A"] and template["optim"]["A"].shape == (3, 3)
    assert template["optim"]["moments"][0] is not moment  # (the list is rebuilt in place)
    assert torch.equal(moment, torch.ones(2, 2))  # the live tensor is untouched
    view = fresh_template({"row": state["A"][1]})["row"]  # shares the lent storage
    assert view is not state["A"] and view.shape == (3,)


def _dtensor_worker(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, world, tmp), record_errors(Path(tmp, f"rank{rank}.error")):
        mesh = init_device_mesh("cpu", (world,))
        param = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
        lent = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        sd = {"model": {"w": param}, "optim": lend({"A": lent})}
        template = fresh_template(sd)
        assert template["model"]["w"] is param  # the model's DTensor: loaded in place
        fresh = template["optim"]["A"]
        assert fresh is not lent and type(fresh) is type(lent)
        assert fresh.to_local().data_ptr() != lent.to_local().data_ptr()
        assert fresh.placements == lent.placements and fresh.shape == lent.shape


def test_dtensors_lent_and_not(tmp_path: Path) -> None:
    spawn(_dtensor_worker, 1, tmp_path)
