"""Checkpoints: round trips in a fresh process, both file formats, errors, atomic writes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import optree
import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.checkpoint.state_format import FORMAT_VERSION, META_KEY

TESTS = Path(__file__).resolve().parent
HYPER: dict[str, Any] = {"damping": 1e-2, "factor_decay": 0.9, "kl_clip": 1e-2, "lr": 0.1}
Params = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- helpers
# (also imported by the child process of the round-trip test)


def _model() -> nn.Module:
    """Layer names with dots: ``encoder.0`` (Conv2d, 2 groups: batched factors), ``head.0``."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            encoder=nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.Tanh()),
            flat=nn.Flatten(),
            head=nn.Sequential(nn.Linear(6 * 4 * 4, 5)),
        )
    )


def _fresh(model: nn.Module, **init: Any) -> kf.KFACState:
    return kf.init(kf.register(model), **init)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


def _train(
    model: nn.Module, params: Params, state: kf.KFACState, steps: int
) -> tuple[Params, kf.KFACState, list[Params]]:
    """``steps`` K-FAC + SGD steps from ``state.step``; inverses every second step."""
    history = []
    for _ in range(steps):
        x, y = _batch(state.step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        grads, state = kf.update(
            state, grads, captures=caps, update_inverses=lambda k: k % 2 == 0, **HYPER
        )
        params = {n: (p - 0.1 * grads[n]).detach() for n, p in params.items()}
        history.append(grads)
    return params, state, history


def _results(params: Params, state: kf.KFACState, history: list[Params]) -> dict[str, torch.Tensor]:
    out = {f"grads.{i}.{n}": g for i, gs in enumerate(history) for n, g in gs.items()}
    out.update({f"params.{n}": p for n, p in params.items()})
    sd = kf.state_to_dict(state, include_decompositions=True)
    out.update({f"state.{k}": v for k, v in sd.items()})
    return out


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, differ


def _assert_states_equal(a: kf.KFACState, b: kf.KFACState) -> None:
    pa, la, sa = optree.tree_flatten_with_path(a)  # type: ignore[arg-type,var-annotated]
    pb, lb, sb = optree.tree_flatten_with_path(b)  # type: ignore[arg-type,var-annotated]
    assert pa == pb and sa == sb  # same layers, decompositions, counters, specs, config, step
    for p, x, y in zip(pa, la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), p
        assert x.stride() == y.stride(), p  # memory layout restored (eigh: column-major)


_TRAINED: dict[str, kf.KFACState] = {}


def _trained() -> kf.KFACState:
    """A state after 3 steps (eigen decompositions with ``dgda``), cached."""
    if "state" not in _TRAINED:
        model = _model()
        _, _TRAINED["state"], _ = _train(
            model, dict(model.named_parameters()), _fresh(model), steps=3
        )
    return _TRAINED["state"]


# --------------------------------------------------------------------------- 1. round trip

_CHILD = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
import kfac_func as kf
import test_serialization as t

for job in json.loads(sys.argv[1]):
    model = t._model()
    params = torch.load(job["params"], weights_only=True)
    state = kf.load_state(job["ckpt"], like=t._fresh(model))
    assert state.step == job["start"]
    params, state, history = t._train(model, params, state, job["steps"])
    torch.save(t._results(params, state, history), job["out"])
"""


def test_round_trip_in_a_fresh_process(tmp_path: Path) -> None:
    """Save after N steps, continue in a fresh process: bit-identical to an uninterrupted run.

    Inverses are updated at even steps. With decompositions saved, resuming after step 3
    (step 3 reuses step 2's decompositions) is bit-identical. Without them, resuming is
    bit-identical when the next step recomputes the decompositions anyway (after step 4),
    or when ``kf.decompose(only_missing=True)`` runs right after loading and the factors
    did not change since the last decomposition (after step 3: step 2 updated both);
    otherwise ``update`` decomposes step 3's factors and the first step differs.
    """
    total, model = 6, _model()
    params, state = dict(model.named_parameters()), _fresh(model)
    history: list[Params] = []
    saved: dict[str, Params] = {}
    for n, include, name in [
        (3, True, "n3_with_decompositions.safetensors"),
        (3, False, "n3_factors_only.pt"),
        (4, False, "n4_factors_only.safetensors"),
    ]:
        params, state, h = _train(model, params, state, n - state.step)
        history += h
        kf.save_state(state, tmp_path / name, include_decompositions=include)
        torch.save(params, tmp_path / f"params_{n}.pt")
        saved[name] = params
    assert any(
        ls.decomposition is not None and ls.decomposition.dgda is not None  # type: ignore[union-attr]
        for ls in state.layers.values()
    )
    assert state.layers["encoder.0"].a_factor.dim() == 3  # grouped conv: batched factors

    jobs = [
        {
            "ckpt": str(tmp_path / name),
            "params": str(tmp_path / f"params_{n}.pt"),
            "start": n,
            "steps": total - n,
            "out": str(tmp_path / f"out_{n}.pt"),
        }
        for n, name in [
            (3, "n3_with_decompositions.safetensors"),
            (4, "n4_factors_only.safetensors"),
        ]
    ]
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(TESTS)))
    child = subprocess.Popen(
        [sys.executable, str(script), json.dumps(jobs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # the rest of the uninterrupted run, and in-process resumes, while the child runs
        params, state, h = _train(model, params, state, total - state.step)
        history += h
        want = {n: _results(params, state, history[n:]) for n in (3, 4)}

        lost = kf.load_state(tmp_path / "n3_factors_only.pt", like=_fresh(model))
        assert all(ls.decomposition is None for ls in lost.layers.values())
        _, _, (first,) = _train(model, saved["n3_factors_only.pt"], lost, 1)
        assert not torch.equal(first["head.0.weight"], history[3]["head.0.weight"])

        eager = kf.decompose(lost, damping=HYPER["damping"], only_missing=True)
        got = _results(*_train(model, saved["n3_factors_only.pt"], eager, total - 3))
        _assert_bit_identical(got, want[3])
    finally:
        _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    for job in jobs:
        _assert_bit_identical(torch.load(job["out"], weights_only=True), want[job["start"]])


# --------------------------------------------------------------------------- 2. formats


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth", ".ckpt"])
@pytest.mark.parametrize("include", [True, False])
def test_file_formats_round_trip(tmp_path: Path, suffix: str, include: bool) -> None:
    state = _trained()
    path = tmp_path / f"kfac{suffix}"
    kf.save_state(state, path, include_decompositions=include)
    assert os.listdir(tmp_path) == [path.name]
    raw = path.read_bytes()
    if suffix in (".pt", ".pth"):
        assert raw[:4] == b"PK\x03\x04"
        flat = torch.load(path, weights_only=True)
    else:
        flat = safetensors.torch.load_file(path)
        with safetensors.safe_open(path, framework="pt") as f:
            header = f.metadata()[META_KEY]
        assert json.loads(header) == json.loads(bytes(flat[META_KEY].tolist()))
    assert all(isinstance(v, torch.Tensor) for v in flat.values())

    loaded = kf.load_state(path, like=_fresh(_model()))
    expected = state
    if not include:
        expected = state.replace(
            layers={n: ls.replace(decomposition=None) for n, ls in state.layers.items()}
        )
    _assert_states_equal(loaded, expected)


def test_in_memory_dict_through_torch_save_and_safetensors_bytes() -> None:
    state = _trained()
    d = kf.state_to_dict(state, include_decompositions=True)
    assert d[META_KEY].dtype == torch.uint8
    meta = json.loads(bytes(d[META_KEY].tolist()))
    assert meta["format_version"] == FORMAT_VERSION and meta["library_version"] == kf.__version__
    assert meta["step"] == 3 and meta["decompositions"] == "eigen"
    assert [e["name"] for e in meta["layers"]] == ["encoder.0", "head.0"]
    enc = meta["layers"][0]
    assert enc["spec"]["groups"] == 2 and enc["spec"]["kernel_size"] == [3, 3]
    assert enc["factor_updates"] == 3 and enc["decomposition"]["type"] == "eigen"
    assert meta["config"]["factor_dtype"] == "float32"

    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    _assert_states_equal(
        kf.state_from_dict(torch.load(buf, weights_only=True), like=_fresh(_model())), state
    )
    blob = safetensors.torch.save(d)
    _assert_states_equal(
        kf.state_from_dict(safetensors.torch.load(blob), like=_fresh(_model())), state
    )


@pytest.mark.parametrize(
    "init",
    [
        {"compute_method": "inverse"},
        {"compute_eigenvalue_outer_product": False},
        {"convention": "kfac-pytorch", "factor_dtype": torch.float64, "inv_dtype": torch.float64},
    ],
)
def test_round_trip_across_configs_and_partial_decompositions(init: dict[str, Any]) -> None:
    model = _model()
    _, state, _ = _train(model, dict(model.named_parameters()), _fresh(model, **init), steps=1)
    # one layer without a decomposition (as a never-updated "fisher" layer would be), one
    # with a column-major decomposition (as torch.linalg.eigh / inv return them)
    layers = dict(state.layers)
    layers["head.0"] = layers["head.0"].replace(decomposition=None, skipped_updates=2)
    col_major = optree.tree_map(lambda t: t.mT.contiguous().mT, layers["encoder.0"].decomposition)
    layers["encoder.0"] = layers["encoder.0"].replace(decomposition=col_major)
    state = state.replace(layers=layers)
    d = kf.state_to_dict(state, include_decompositions=True)
    assert all(t.is_contiguous() for t in d.values())
    strides = json.loads(bytes(d[META_KEY].tolist()))["strides"]
    first = "qa" if init.get("compute_method", "eigen") == "eigen" else "a_inv"
    assert strides[f"layers.encoder.0.decomposition.{first}"] == [19 * 19, 1, 19]
    if init.get("compute_eigenvalue_outer_product") is False:
        assert "layers.encoder.0.decomposition.qa" in d
        assert "layers.encoder.0.decomposition.dgda" not in d
    loaded = kf.state_from_dict(d, like=_fresh(_model(), **init))
    _assert_states_equal(loaded, state)  # values, dtypes and strides
    assert loaded.layers["head.0"].skipped_updates == 2
    assert loaded.layers["head.0"].decomposition is None


# --------------------------------------------------------------------------- 3. errors


def test_wrong_model_lists_every_missing_extra_and_misshaped_layer() -> None:
    d = kf.state_to_dict(_trained())
    other = nn.Sequential(
        OrderedDict(
            encoder=nn.Sequential(nn.Conv2d(2, 6, 3, groups=2), nn.Tanh()),  # mis-shaped
            decoder=nn.Sequential(nn.Identity(), nn.Linear(3, 3)),  # missing from the file
        )
    )  # and no head.0: extra in the file
    with pytest.raises(kf.checkpoint.CheckpointMismatchError) as info:
        kf.state_from_dict(d, like=_fresh(other))
    e = info.value
    assert isinstance(e, ValueError)
    assert e.missing == ["decoder.1"] and e.extra == ["head.0"] and e.config == []
    assert list(e.mismatched) == ["encoder.0"]
    msg = str(e)
    assert "missing layers" in msg and "'decoder.1'" in msg
    assert "extra layers" in msg and "'head.0'" in msg
    assert "layer 'encoder.0'" in msg and "in_dim 4 vs 2" in msg
    assert "a_factor shape (2, 19, 19) in the checkpoint, (2, 10, 10) in like" in msg
    again = pickle.loads(pickle.dumps(e))  # e.g. raised in a worker process
    assert str(again) == msg and again.mismatched == e.mismatched


def test_wrong_dtype() -> None:
    d = kf.state_to_dict(_trained(), include_decompositions=True)
    # the whole checkpoint in another precision: config and every layer listed
    with pytest.raises(kf.checkpoint.CheckpointMismatchError) as info:
        kf.state_from_dict(d, like=_fresh(_model(), factor_dtype=torch.float64))
    assert info.value.config == ["factor_dtype: 'float32' in the checkpoint, 'float64' in like"]
    assert sorted(info.value.mismatched) == ["encoder.0", "head.0"]
    assert "a_factor dtype torch.float32 in the checkpoint, torch.float64 in like" in str(
        info.value
    )
    # one tensor of another dtype than its metadata says
    d = dict(d)
    d["layers.head.0.decomposition.qg"] = d["layers.head.0.decomposition.qg"].double()
    with pytest.raises(kf.checkpoint.CheckpointMismatchError) as info:
        kf.state_from_dict(d, like=_fresh(_model()))
    assert info.value.mismatched == {
        "head.0": ["decomposition.qg dtype torch.float64 in the checkpoint, torch.float32 in like"]
    }


def test_different_convention_and_compute_method_in_one_error(tmp_path: Path) -> None:
    path = tmp_path / "kfac.safetensors"
    kf.save_state(_trained(), path)
    like = _fresh(_model(), convention="kfac-pytorch", compute_method="inverse")
    with pytest.raises(kf.checkpoint.CheckpointMismatchError) as info:
        kf.load_state(path, like=like)
    assert info.value.config == [
        "convention: 'fisher' in the checkpoint, 'kfac-pytorch' in like",
        "compute_method: 'eigen' in the checkpoint, 'inverse' in like",
    ]
    msg = str(info.value)
    assert "convention" in msg and "compute_method" in msg and str(path) in msg


def _with_meta(d: dict[str, torch.Tensor], **changes: Any) -> dict[str, torch.Tensor]:
    meta = json.loads(bytes(d[META_KEY].tolist()))
    meta.update(changes)
    raw = bytearray(json.dumps(meta).encode())
    return {**d, META_KEY: torch.frombuffer(raw, dtype=torch.uint8)}


def test_future_format_version(tmp_path: Path) -> None:
    d = _with_meta(kf.state_to_dict(_trained()), format_version=FORMAT_VERSION + 1)
    path = tmp_path / "future.safetensors"
    safetensors.torch.save_file(d, path)
    with pytest.raises(kf.checkpoint.CheckpointFormatError) as info:
        kf.load_state(path, like=_fresh(_model()))
    msg = str(info.value)
    assert f"format version {FORMAT_VERSION + 1}" in msg
    assert f"reads format version {FORMAT_VERSION}" in msg and str(path) in msg


def test_a_retired_grafting_moment_is_refused_naming_the_layer() -> None:
    """A checkpoint written while Adam grafting ran holds its running moment; grafting was
    retired, so it is refused, naming the layer (one written without it loads)."""
    d = kf.state_to_dict(_trained())
    meta = json.loads(bytes(d[META_KEY].tolist()))
    kf.state_from_dict(
        _with_meta(d, layers=[{**e, "graft_moment": False} for e in meta["layers"]]),
        like=_fresh(_model()),
    )
    first = meta["layers"][0]
    layers = [{**first, "graft_moment": True}, *meta["layers"][1:]]
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="grafting was retired") as info:
        kf.state_from_dict(_with_meta(d, layers=layers), like=_fresh(_model()))
    assert repr(first["name"]) in str(info.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("cut", ["last byte", "half", "all but 3 bytes"])
def test_truncated_file(tmp_path: Path, suffix: str, cut: str) -> None:
    path = tmp_path / f"kfac{suffix}"
    kf.save_state(_trained(), path, include_decompositions=True)
    raw = path.read_bytes()
    keep = {"last byte": len(raw) - 1, "half": len(raw) // 2, "all but 3 bytes": 3}[cut]
    path.write_bytes(raw[:keep])
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="truncated or corrupt") as info:
        kf.load_state(path, like=_fresh(_model()))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".bin"])
def test_garbage_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"kfac{suffix}"
    path.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(kf.checkpoint.CheckpointFormatError) as info:
        kf.load_state(path, like=_fresh(_model()))
    assert str(path) in str(info.value)
    with pytest.raises(FileNotFoundError):
        kf.load_state(tmp_path / "absent.safetensors", like=_fresh(_model()))


def test_missing_or_malformed_metadata(tmp_path: Path) -> None:
    d = kf.state_to_dict(_trained())
    no_meta = {k: v for k, v in d.items() if k != META_KEY}
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="no '__kfac_meta__' metadata"):
        kf.state_from_dict(no_meta, like=_fresh(_model()))
    for path in (tmp_path / "plain.safetensors", tmp_path / "plain.pt"):
        if path.suffix == ".pt":
            torch.save(no_meta, path)
        else:
            safetensors.torch.save_file(no_meta, path)
        with pytest.raises(kf.checkpoint.CheckpointFormatError, match="metadata") as info:
            kf.load_state(path, like=_fresh(_model()))
        assert str(path) in str(info.value)
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="not valid UTF-8 JSON"):
        kf.state_from_dict(
            {**d, META_KEY: torch.tensor([1, 2], dtype=torch.uint8)}, like=_trained()
        )
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="'step' has the wrong type"):
        kf.state_from_dict(_with_meta(d, step="3"), like=_trained())
    # tensors and metadata disagree
    missing_tensor = {k: v for k, v in d.items() if k != "layers.head.0.g_factor"}
    with pytest.raises(
        kf.checkpoint.CheckpointFormatError, match=r"missing: 'layers\.head\.0\.g_factor'"
    ):
        kf.state_from_dict(missing_tensor, like=_trained())
    with pytest.raises(
        kf.checkpoint.CheckpointFormatError, match=r"unexpected keys: 'model\.weight'"
    ):
        kf.state_from_dict({**d, "model.weight": torch.ones(1)}, like=_trained())


# --------------------------------------------------------------------------- 4. atomicity


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_exception_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    path = tmp_path / f"kfac{suffix}"
    kf.save_state(_trained(), path, include_decompositions=True)
    before = path.read_bytes()
    calls = []

    def partial_write(*args: Any, **kwargs: Any) -> None:
        target = args[1]  # safetensors: file name; torch.save: open file object
        calls.append(target)
        if isinstance(target, (str, os.PathLike)):
            Path(target).write_bytes(before[:100])
        else:
            target.write(before[:100])
            target.flush()
        if suffix == ".pt":
            raise KeyboardInterrupt  # not an Exception: cleaned up too
        raise OSError(28, "No space left on device")

    if suffix == ".pt":
        monkeypatch.setattr(torch, "save", partial_write)
    else:
        monkeypatch.setattr(safetensors.torch, "save_file", partial_write)
    other = _trained().replace(step=99)
    with pytest.raises(KeyboardInterrupt if suffix == ".pt" else OSError):
        kf.save_state(other, path)
    monkeypatch.undo()

    assert len(calls) == 1
    assert os.listdir(tmp_path) == [path.name]  # no temp file left behind
    assert path.read_bytes() == before
    _assert_states_equal(kf.load_state(path, like=_fresh(_model())), _trained())


_KILLED_WRITER = """
import os, sys, time
from torch import nn
import kfac_func as kf

path, marker = sys.argv[1], sys.argv[2]
big = kf.init(kf.register(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512))),
              convention="kfac-pytorch")
real_replace = os.replace

def slow_replace(src, dst):
    with open(marker + ".part", "w") as f:
        f.write(src)
    os.rename(marker + ".part", marker)
    time.sleep(120)  # killed here: temp file written and fsynced, not yet renamed
    real_replace(src, dst)

os.replace = slow_replace
kf.save_state(big, path)
"""


def test_killed_writer_leaves_previous_checkpoint(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    path = ckpt_dir / "kfac.safetensors"
    kf.save_state(_trained(), path, include_decompositions=True)
    before = path.read_bytes()
    script, marker = tmp_path / "writer.py", tmp_path / "marker"
    script.write_text(_KILLED_WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), str(marker)], stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, f"writer exited early: {proc.stderr.read()!r}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "writer never reached os.replace"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    tmp_file = Path(marker.read_text())
    assert tmp_file.parent == ckpt_dir and tmp_file.exists()
    assert tmp_file.stat().st_size > 8 * 1024 * 1024  # the new state was written, not renamed
    assert path.read_bytes() == before
    _assert_states_equal(kf.load_state(path, like=_fresh(_model())), _trained())


# --------------------------------------------------------------------------- 5. optree paths


@pytest.mark.parametrize("outer_product", [True, False])
def test_keys_are_optree_paths(outer_product: bool) -> None:
    model = _model()
    init = {"compute_eigenvalue_outer_product": outer_product}
    _, state, _ = _train(model, dict(model.named_parameters()), _fresh(model, **init), steps=1)
    paths, leaves, _ = optree.tree_flatten_with_path(state)  # type: ignore[arg-type,var-annotated]
    by_path = {".".join(map(str, p)): leaf for p, leaf in zip(paths, leaves)}
    assert "layers.encoder.0.decomposition.qa" in by_path
    assert ("layers.head.0.decomposition.dgda" in by_path) == outer_product

    full = kf.state_to_dict(state, include_decompositions=True)
    assert set(full) - {META_KEY} == set(by_path)
    assert all(torch.equal(full[k], v) for k, v in by_path.items())
    factors_only = kf.state_to_dict(state)
    assert set(factors_only) - {META_KEY} == {
        k for p, k in zip(paths, by_path) if p[2] != "decomposition"
    }


def test_checksum_digests_are_those_of_earlier_checkpoints() -> None:
    """The digest reads a tensor's memory where it lies (no Python loop over its bytes),
    and gives the SHA-256 that checkpoints written by earlier versions recorded (their
    values below), of any dtype and layout."""
    from kfac_func.checkpoint.checksums import add_checksums, tensor_digest, verify_checksums

    t = torch.arange(6.0).reshape(2, 3).mT  # not contiguous
    assert tensor_digest(t) == "0af938f1a2bfae9f4b52614368335338bfe4a0845f202313797d680c21ba96a6"
    assert tensor_digest(t.bfloat16()) == (
        "c1da9b55275b1f2a90bd1d0e5cf875875becca731daaad7e2fde3a859e6d7e74"
    )
    for x in (torch.tensor(True), torch.zeros(0, 3), torch.randn(3, 4, dtype=torch.float64)):
        h = hashlib.sha256(f"{x.dtype} {tuple(x.shape)}".encode())
        h.update(x.contiguous().numpy().tobytes())
        assert tensor_digest(x) == h.hexdigest()
    sd = add_checksums({f"l{i}": {"A": torch.randn(64, 64)} for i in range(5)})
    verify_checksums(sd)  # on several threads
    sd["l3"]["A"][7, 7] += 1.0
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match=r"'l3\.A' does not match"):
        verify_checksums(sd)
