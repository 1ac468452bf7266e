"""`kf.KFAC` through `torch.distributed.checkpoint` on one process: ``get_state_dict`` /
``set_state_dict`` with their default strictness carry all of its state, K-FAC's factors
and decompositions included; a flipped bit in a saved factor is refused naming the tensor;
``kf.save_dcp`` leaves the previous checkpoint whole when a save is killed.

Each round trip saves after ``CUT`` steps (the decompositions of step 2 are used at
step 3, after the load: none is recomputed) and must then train as the run that never
saved (float64, bit for bit), while the run that saved must not be moved by the save.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.checkpoint import atomic_dcp

dcp = pytest.importorskip("torch.distributed.checkpoint")
state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")

F64 = torch.float64
STEPS, CUT = 6, 3
FACTOR = "optim.param_groups.0.kfac.layers.2.A"

CONFIGS: dict[str, dict[str, Any]] = {
    # the base optimizer keeps no state: torch's strict load used to refuse it
    "sgd": {},
    # momentum, AdamW for the embedding, eigenbasis moments with a first moment
    "momentum_moments": {
        "base_kwargs": {"momentum": 0.9},
        "eigenbasis_moments": True,
        "moment_beta1": 0.9,
        "moment_eps": 1e-4,
    },
}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def setup(name: str, seed: int = 0) -> tuple[nn.Module, kf.KFAC]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(6, 4), nn.Flatten(), nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 3)
    ).to(F64)
    opt = kf.KFAC(
        model,
        recipe="kfac-pytorch",
        lr=0.1,
        damping=0.01,
        inv_update_steps=2,
        factor_dtype=F64,
        inv_dtype=F64,
        skip_layers=["Embedding"],
        **CONFIGS[name],
    )
    return model, opt


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 6, (8, 2), generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(STEPS)
    ]


def train(model: nn.Module, opt: kf.KFAC, data: list[Any]) -> None:
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def save(model: nn.Module, opt: kf.KFAC, path: Path) -> None:
    model_sd, optim_sd = state_dict_api.get_state_dict(model, opt)
    kf.save_dcp({"model": model_sd, "optim": optim_sd}, path)


def load(model: nn.Module, opt: kf.KFAC, path: Path) -> None:
    model_sd, optim_sd = state_dict_api.get_state_dict(model, opt)  # the template
    sd = {"model": model_sd, "optim": optim_sd}
    kf.load_dcp(sd, path)
    state_dict_api.set_state_dict(
        model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
    )


def same_state(a: kf.KFAC, b: kf.KFAC) -> None:
    assert a.preconditioner.steps == b.preconditioner.steps
    for name, la in a.preconditioner.state.layers.items():
        lb = b.preconditioner.state.layers[name]
        assert torch.equal(la.a_factor, lb.a_factor) and torch.equal(la.g_factor, lb.g_factor)
        assert la.decomposition is not None and lb.decomposition is not None, name
        for k, v in vars(la.decomposition).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, getattr(lb.decomposition, k)), (name, k)
        for k in ("basis_moment", "basis_momentum"):
            va, vb = getattr(la, k), getattr(lb, k)
            assert (va is None) == (vb is None) and (va is None or torch.equal(va, vb))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_with_default_strictness(tmp_path: Path, name: str) -> None:
    data = batches()
    straight, straight_opt = setup(name)
    train(straight, straight_opt, data)

    model, opt = setup(name)
    train(model, opt, data[:CUT])
    opt.zero_grad()  # no gradients: DCP would step a stateless optimizer to create state
    save(model, opt, tmp_path / "ckpt")
    assert opt.preconditioner.steps == CUT  # saving stepped nothing
    saved = opt.state_dict()

    resumed, resumed_opt = setup(name, seed=5)  # other weights: all comes from the checkpoint
    load(resumed, resumed_opt, tmp_path / "ckpt")
    same_state(resumed_opt, opt)
    if name != "sgd":
        assert len(resumed_opt.state) == len(opt.state) > 0  # momentum and AdamW's moments
    assert resumed_opt.state_dict()["param_groups"][1]["lr"] == saved["param_groups"][1]["lr"]

    train(model, opt, data[CUT:])
    train(resumed, resumed_opt, data[CUT:])
    want = params(straight)
    for got in (params(model), params(resumed)):
        assert all(torch.equal(got[k], want[k]) for k in want)


def _flip_bit(path: Path, key: str, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of ``key``'s values in the checkpoint's shard file."""
    meta = dcp.FileSystemReader(path).read_metadata()
    [info] = [v for k, v in meta.storage_data.items() if k.fqn == key]
    shard = path / info.relative_path
    raw = bytearray(shard.read_bytes())
    item = bytes(raw[info.offset : info.offset + info.length])
    values = tensor.detach().contiguous().numpy().tobytes()
    at = item.find(values)
    assert at >= 0, "the tensor's bytes are not stored as they are"
    raw[info.offset + at + len(values) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))


def test_a_flipped_bit_in_a_factor_is_refused(tmp_path: Path) -> None:
    model, opt = setup("sgd")
    train(model, opt, batches()[:CUT])
    save(model, opt, tmp_path / "ckpt")
    _flip_bit(tmp_path / "ckpt", FACTOR, opt.preconditioner.state.layers["2"].a_factor)

    fresh, fresh_opt = setup("sgd")
    before = fresh_opt.preconditioner.state.layers["2"].a_factor.clone()
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match=r"'layers\.2\.A' does not match"):
        load(fresh, fresh_opt, tmp_path / "ckpt")
    assert fresh_opt.preconditioner.steps == 0  # nothing of K-FAC was loaded
    assert torch.equal(fresh_opt.preconditioner.state.layers["2"].a_factor, before)


def test_a_killed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "latest"
    data = batches()
    model, opt = setup("sgd")
    train(model, opt, data[:2])
    save(model, opt, ckpt)
    first = opt.state_dict()["param_groups"][0]["kfac"]["layers"]["2"]["A"].clone()
    train(model, opt, data[2:4])

    # killed while writing its shard: after the first item
    import torch.distributed.checkpoint.filesystem as fs

    write = fs._write_item
    written: list[int] = []

    def dies(*args: Any, **kwargs: Any) -> Any:
        if written:
            raise RuntimeError("killed")
        written.append(1)
        return write(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", dies)
    with pytest.raises(dcp.api.CheckpointException, match="killed"):
        save(model, opt, ckpt)
    monkeypatch.undo()
    assert (tmp_path / ".latest.partial").exists()  # the killed save's leftovers
    fresh, fresh_opt = setup("sgd", seed=5)
    load(fresh, fresh_opt, ckpt)
    assert fresh_opt.preconditioner.steps == 2
    assert torch.equal(fresh_opt.preconditioner.state.layers["2"].a_factor, first)

    # killed between the renames: the previous checkpoint is read from its backup
    rename = atomic_dcp._rename
    calls: list[str] = []

    def dies_on_second(src: Path, dst: Path) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    monkeypatch.setattr(atomic_dcp, "_rename", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        save(model, opt, ckpt)
    monkeypatch.undo()
    assert not ckpt.exists() and atomic_dcp.previous_path(ckpt).exists()
    fresh, fresh_opt = setup("sgd", seed=5)
    load(fresh, fresh_opt, ckpt)
    assert fresh_opt.preconditioner.steps == 2

    save(model, opt, ckpt)  # a save that completes replaces it and leaves nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    fresh, fresh_opt = setup("sgd", seed=5)
    load(fresh, fresh_opt, ckpt)
    assert fresh_opt.preconditioner.steps == 4
