"""Sharded factor checkpoints: round trips, safe file names, incomplete directories, and
resuming a 4-rank run on 2 ranks and on 1 process.

The resharding tests spawn each world size once (a module-scoped fixture): 4 gloo ranks
train ``N`` steps with ``kf.distributed.update_distributed`` and save; 2 fresh gloo ranks, and the
test process itself (world 1), load with the plan of their world size and continue ``M``
steps. Every rank takes its slice of a fixed global batch; gradients are the global
batch's (what DDP's average gives). The preconditioned gradients must equal those of an
uninterrupted ``kf.update`` run on the global batches (float64, 1e-10).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import kfac_func as kf
import kfac_func.checkpoint.factor_dir as ff
import kfac_func.checkpoint.factor_manifest as fm
from kfac_func.distributed.plan import DistributedStrategy

N, M = 3, 3  # steps before the save, steps after the load
GLOBAL_BATCH = 12  # split over 4 ranks (3 each) and over 2 ranks (6 each)
LR = 0.1
TOL = 1e-10
HYPER: dict[str, Any] = dict(damping=0.01, factor_decay=0.9, kl_clip=1e-2, lr=LR)


def inverse_every_3(step: int) -> bool:  # steps 0 and 3: the first resumed step decomposes
    return step % 3 == 0


def inverse_every_2(step: int) -> bool:  # steps 0, 2, 4: step 3 reuses step 2's decompositions
    return step % 2 == 0


# without decompositions in the files, the first resumed step must be an inverse step;
# with them, it need not be
SCHEDULES: dict[bool, Callable[[int], bool]] = {False: inverse_every_3, True: inverse_every_2}

# (strategy on 4 ranks, strategy of the resumed 2-rank run, include_decompositions)
CONFIGS = [
    ("MEM_OPT", "MEM_OPT", False),
    ("COMM_OPT", "COMM_OPT", False),
    ("MEM_OPT", "COMM_OPT", True),
    ("HYBRID_OPT", "MEM_OPT", True),
]


def _label(config: tuple[str, str, bool]) -> str:
    save, resume, include = config
    return f"{save}-to-{resume}-{'dec' if include else 'factors'}"


def make_model() -> nn.Module:
    """A grouped Conv2d (batched factors), Linear layers with and without bias, dotted and
    upper-case names: ``stem.0``, ``body.0``, ``body.2``, ``Head``."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.ReLU()),
            flat=nn.Flatten(),
            body=nn.Sequential(
                nn.Linear(4 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh()
            ),
            Head=nn.Linear(8, 3),
        )
    ).double()


def init_state(layers: kf.LayerTable) -> kf.KFACState:
    return kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def trajectory(schedule: Callable[[int], bool]) -> list[dict[str, Any]]:
    """The uninterrupted single-process run (``kf.update`` on the global batches, N+M
    steps; parameters follow it) and, per step, each rank's captures of its slice: for 4
    ranks in the first N steps, for 2 ranks in the last M."""
    model = make_model()
    layers = kf.register(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_state(layers)
    steps = []
    for step in range(N + M):
        x, y = global_batch(step)
        _, grads, caps = kf.capture(
            model, params, x, lambda o, y=y: F.cross_entropy(o, y), layers=layers
        )
        out, state = kf.update(state, grads, captures=caps, update_inverses=schedule, **HYPER)
        world = 4 if step < N else 2
        local = []
        for rank in range(world):
            sl = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
            _, _, c = kf.capture(
                model, params, x[sl], lambda o, y=y, sl=sl: F.cross_entropy(o, y[sl]), layers=layers
            )
            local.append(c)
        steps.append({"grads": grads, "caps": caps, "local": local, "out": out})
        params = {k: params[k] - LR * out[k] for k in params}
    return steps


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_states_equal(a: kf.KFACState, b: kf.KFACState) -> None:
    """Same structure, counters, specs, config and step; leaves equal, same layout."""
    pa, la, sa = optree.tree_flatten_with_path(a)  # type: ignore[arg-type,var-annotated]
    pb, lb, sb = optree.tree_flatten_with_path(b)  # type: ignore[arg-type,var-annotated]
    assert pa == pb and sa == sb
    for p, x, y in zip(pa, la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), p
        assert x.stride() == y.stride(), p


_CACHE: dict[str, Any] = {}


def trained() -> kf.KFACState:
    """The reference state after N steps (eigen decompositions with dgda), cached."""
    if "state" not in _CACHE:
        model = make_model()
        layers = kf.register(model)
        params = dict(model.named_parameters())
        state = init_state(layers)
        for step in range(N):
            x, y = global_batch(step)
            _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
            _, state = kf.update(state, grads, captures=caps, **HYPER)
        _CACHE["state"] = state
    state: kf.KFACState = _CACHE["state"]
    return state


def fresh() -> kf.KFACState:
    return init_state(kf.register(make_model()))


# --------------------------------------------------------------------------- 1. round trip


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("with_plan", [False, True])
def test_round_trip_equals_state_dict_round_trip(
    tmp_path: Path, include: bool, with_plan: bool
) -> None:
    state = trained()
    assert all(ls.decomposition is not None for ls in state.layers.values())
    plan = kf.distributed.make_plan(kf.register(make_model()), 1) if with_plan else None
    kf.checkpoint.save_factor_dir(state, tmp_path, plan=plan, include_decompositions=include)
    loaded = kf.checkpoint.load_factor_dir(tmp_path, like=fresh(), plan=plan)
    want = kf.state_from_dict(kf.state_to_dict(state, include_decompositions=include), like=fresh())
    assert_states_equal(loaded, want)
    assert loaded.step == N and list(loaded.layers) == list(state.layers)
    assert all(ls.factor_updates == N for ls in loaded.layers.values())
    assert all((ls.decomposition is not None) is include for ls in loaded.layers.values())

    manifest = kf.checkpoint.read_factor_manifest(tmp_path)
    assert manifest["step"] == N and manifest["world_size"] == 1
    assert manifest["include_decompositions"] is include
    assert [e["name"] for e in manifest["layers"]] == list(state.layers)
    assert {e["writer"] for e in manifest["layers"]} == {0}
    for e in manifest["layers"]:
        raw = (tmp_path / e["file"]).read_bytes()
        assert e["bytes"] == len(raw) and e["sha256"] == hashlib.sha256(raw).hexdigest()
        # each file is an ordinary single-layer checkpoint
        single = kf.load_state(tmp_path / e["file"], like=_only(fresh(), e["name"]))
        assert torch.equal(single.layers[e["name"]].a_factor, state.layers[e["name"]].a_factor)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [kf.checkpoint.layer_file_name(n) for n in state.layers] + [fm.MANIFEST_NAME]
    )


def _only(state: kf.KFACState, name: str) -> kf.KFACState:
    return state.replace(layers={name: state.layers[name]})


def test_only_owned_reads_the_owned_layers_under_mem_opt(tmp_path: Path) -> None:
    state = trained()
    kf.checkpoint.save_factor_dir(state, tmp_path, include_decompositions=True)
    layers = kf.register(make_model())
    plan = kf.distributed.make_plan(layers, 2, grad_worker_fraction=DistributedStrategy.MEM_OPT)
    owners = {n: plan.layers[n].a_owner for n in layers}
    assert set(owners.values()) == {0, 1}
    like = fresh()
    for rank in (0, 1):
        got = kf.checkpoint.load_factor_dir(
            tmp_path, like=like, plan=plan, rank=rank, only_owned=True
        )
        assert got.step == N
        for n in layers:
            if owners[n] == rank:
                assert_states_equal(_only(got, n), _only(state, n))
            else:
                assert got.layers[n] is like.layers[n]
    # everything, whatever the rank, without only_owned
    assert_states_equal(
        kf.checkpoint.load_factor_dir(tmp_path, like=like, plan=plan, rank=1), state
    )


# --------------------------------------------------------------------------- 2. file names

ODD_NAMES = ["../evil", "/abs/path", "a/b", "..", ".", "x" * 500, "über", "a\x00b", "", "a\\b"]
ODD_NAMES += ["C:\\x", "Fc", "fc", "FC", "%2F", "layer.x", "manifest.json", "~", " ", "x" * 499]


def _assert_plain(file: str) -> None:
    assert file.isascii() and file.isprintable()
    assert file == os.path.basename(file) and not os.path.isabs(file)
    assert not any(c in file for c in '/\\\0:*?"<>| ')
    assert file.startswith("layer.") and file.endswith(".safetensors")
    assert file not in (".", "..", fm.MANIFEST_NAME)
    assert len(file.encode()) <= 210
    # the temporary file of the atomic writer fits NAME_MAX too
    assert len(f".{file}.{'0' * 12}.tmp") <= 255
    root = os.path.abspath("/ckpt/dir")
    assert os.path.dirname(os.path.normpath(os.path.join(root, file))) == root


def test_odd_layer_names_round_trip_inside_the_directory(tmp_path: Path) -> None:
    base = kf.register(nn.Linear(3, 2))[""]
    specs = {n: dataclasses.replace(base, name=n) for n in ODD_NAMES}
    state = kf.init(specs, factor_dtype=torch.float64)
    state = state.replace(
        step=7,
        layers={
            n: ls.replace(a_factor=ls.a_factor + i, factor_updates=i)
            for i, (n, ls) in enumerate(state.layers.items())
        },
    )
    ckpt = tmp_path / "ckpt"
    kf.checkpoint.save_factor_dir(state, ckpt)
    files = {n: kf.checkpoint.layer_file_name(n) for n in ODD_NAMES}
    for f in files.values():
        _assert_plain(f)
    assert len(set(files.values())) == len(ODD_NAMES)
    assert len({f.casefold() for f in files.values()}) == len(ODD_NAMES)
    assert files["x" * 500] != files["x" * 499]  # both cut, told apart by the hash
    # nothing was written outside the directory; the manifest maps names to the files
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(ckpt)) == sorted([*files.values(), fm.MANIFEST_NAME])
    manifest = kf.checkpoint.read_factor_manifest(ckpt)
    assert {e["name"]: e["file"] for e in manifest["layers"]} == files
    loaded = kf.checkpoint.load_factor_dir(ckpt, like=kf.init(specs, factor_dtype=torch.float64))
    assert_states_equal(loaded, state)


def test_file_names_examples() -> None:
    assert kf.checkpoint.layer_file_name("encoder.0") == "layer.encoder.0.safetensors"
    assert kf.checkpoint.layer_file_name("..") == "layer....safetensors"
    assert kf.checkpoint.layer_file_name("a/b") == "layer.a%2Fb.safetensors"
    assert kf.checkpoint.layer_file_name("über") == "layer.%C3%BCber.safetensors"
    assert kf.checkpoint.layer_file_name("a\x00b") == "layer.a%00b.safetensors"
    assert (
        kf.checkpoint.layer_file_name("\ud800") == "layer.%ED%A0%80.safetensors"
    )  # lone surrogate
    long = kf.checkpoint.layer_file_name("ü" * 100)
    assert "~" in long and "%C3%BC" in long and len(long) <= 210
    with pytest.raises(TypeError):
        kf.checkpoint.layer_file_name(3)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.sets(st.text(max_size=300), max_size=12))
def test_file_names_are_plain_and_distinct(names: set[str]) -> None:
    files = [kf.checkpoint.layer_file_name(n) for n in names]
    for f in files:
        _assert_plain(f)
    assert len(set(files)) == len(names)
    assert len({f.casefold() for f in files}) == len(names)  # case-insensitive file systems


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.sets(st.text(max_size=60), min_size=1, max_size=4))
def test_text_names_round_trip_through_files(tmp_path: Path, names: set[str]) -> None:
    base = kf.register(nn.Linear(2, 1))[""]
    specs = {n: dataclasses.replace(base, name=n) for n in sorted(names)}
    state = kf.init(specs).replace(step=3)
    ckpt = tmp_path / hashlib.sha256(repr(sorted(names)).encode()).hexdigest()[:12]
    kf.checkpoint.save_factor_dir(state, ckpt)
    assert sorted(os.listdir(ckpt)) == sorted(
        [kf.checkpoint.layer_file_name(n) for n in names] + [fm.MANIFEST_NAME]
    )
    m = kf.checkpoint.read_factor_manifest(ckpt)
    assert sorted(e["name"] for e in m["layers"]) == sorted(names)
    assert kf.checkpoint.load_factor_dir(ckpt, like=kf.init(specs)).step == 3


# --------------------------------------------------------------------------- 3. incomplete


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    kf.checkpoint.save_factor_dir(trained(), tmp_path / "ckpt", include_decompositions=True)
    return tmp_path / "ckpt"


def _manifest(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((path / fm.MANIFEST_NAME).read_text())
    return result


def _entry(path: Path, name: str) -> dict[str, Any]:
    return next(e for e in _manifest(path)["layers"] if e["name"] == name)


def test_missing_manifest_is_refused(saved: Path) -> None:
    (saved / fm.MANIFEST_NAME).unlink()
    with pytest.raises(kf.checkpoint.CheckpointFormatError) as info:
        kf.checkpoint.load_factor_dir(saved, like=fresh())
    msg = str(info.value)
    assert "no manifest.json" in msg and "interrupted" in msg and "4 layer file(s)" in msg
    assert str(saved) in msg
    with pytest.raises(FileNotFoundError):
        kf.checkpoint.load_factor_dir(saved / "absent", like=fresh())


def test_missing_and_truncated_files_are_named(saved: Path) -> None:
    head, stem = _entry(saved, "Head"), _entry(saved, "stem.0")
    (saved / head["file"]).unlink()
    raw = (saved / stem["file"]).read_bytes()
    (saved / stem["file"]).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(kf.checkpoint.CheckpointFormatError) as info:
        kf.checkpoint.load_factor_dir(saved, like=fresh())
    msg = str(info.value)
    assert "incomplete or damaged" in msg
    assert f"layer 'Head': file {head['file']!r} is missing" in msg
    assert f"layer 'stem.0': file {stem['file']!r} has {len(raw) // 2} bytes" in msg
    assert "truncated" in msg
    # also under only_owned, for layers the rank does not read
    plan = kf.distributed.make_plan(kf.register(make_model()), 2, grad_worker_fraction=0.5)
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="'Head'"):
        kf.checkpoint.load_factor_dir(saved, like=fresh(), plan=plan, rank=0, only_owned=True)


def test_altered_file_of_the_same_size_is_refused(saved: Path) -> None:
    e = _entry(saved, "body.2")
    raw = bytearray((saved / e["file"]).read_bytes())
    raw[-1] ^= 1  # last byte of the last tensor: still a well-formed file
    (saved / e["file"]).write_bytes(bytes(raw))
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match=r"'body\.2'.*SHA-256"):
        kf.checkpoint.load_factor_dir(saved, like=fresh())


def test_file_of_another_step_is_refused(saved: Path, tmp_path: Path) -> None:
    """A file of another save that matches the manifest's size and digest (only possible
    if the manifest was rewritten) is still caught by its step."""
    other = tmp_path / "other"
    kf.checkpoint.save_factor_dir(trained().replace(step=N + 2), other, include_decompositions=True)
    e = _entry(other, "body.0")
    (saved / e["file"]).write_bytes((other / e["file"]).read_bytes())
    manifest = _manifest(saved)
    for entry in manifest["layers"]:
        if entry["name"] == "body.0":
            entry.update(bytes=e["bytes"], sha256=e["sha256"])
    (saved / fm.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(
        kf.checkpoint.CheckpointFormatError, match=r"holds step 5, the manifest step 3"
    ):
        kf.checkpoint.load_factor_dir(saved, like=fresh())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format_version": fm.MANIFEST_FORMAT_VERSION + 1}, "upgrade kfac_func"),
        ({"format": "something else"}, "does not describe"),
        ({"step": "3"}, "'step' is missing or of the wrong type"),
        (
            {"layers": [{"name": "x", "file": "../x.safetensors", "bytes": 1, "sha256": ""}]},
            "not a plain file name",
        ),
        (
            {"layers": [{"name": "x", "file": "/etc/passwd", "bytes": 1, "sha256": ""}]},
            "not a plain file name",
        ),
        (
            {"layers": [{"name": "x", "file": "manifest.json", "bytes": 1, "sha256": ""}]},
            "not a plain file name",
        ),
    ],
)
def test_malformed_or_future_manifest(saved: Path, change: dict[str, Any], match: str) -> None:
    (saved / fm.MANIFEST_NAME).write_text(json.dumps({**_manifest(saved), **change}))
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match=match):
        kf.checkpoint.load_factor_dir(saved, like=fresh())


def test_not_json_manifest(saved: Path) -> None:
    (saved / fm.MANIFEST_NAME).write_bytes(b"{\xff")
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="not valid UTF-8 JSON"):
        kf.checkpoint.load_factor_dir(saved, like=fresh())


def test_other_model_lists_every_layer_problem(saved: Path) -> None:
    other = nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)),  # mis-shaped
            body=nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Identity(), nn.Linear(8, 8)),
        )  # body.2 and Head extra in the directory, body.3 missing from it
    )
    like = kf.init(kf.register(other), factor_dtype=torch.float32, inv_dtype=torch.float64)
    with pytest.raises(kf.checkpoint.CheckpointMismatchError) as info:
        kf.checkpoint.load_factor_dir(saved, like=like)
    e = info.value
    assert e.missing == ["body.3"] and e.extra == ["body.2", "Head"]
    assert e.config == ["factor_dtype: 'float64' in the checkpoint, 'float32' in like"]
    assert sorted(e.mismatched) == ["body.0", "stem.0"]
    assert "in_dim 2 vs 4" in str(e) and e.source == str(saved)


def test_interrupted_save_leaves_no_manifest(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-saving over a committed directory removes its manifest first: a save that fails
    half-way leaves a directory that is refused, never old manifest + new files."""
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        kf.save_state(*args, **kwargs)

    monkeypatch.setattr(ff, "save_state", failing)
    with pytest.raises(OSError, match="disk full"):
        kf.checkpoint.save_factor_dir(trained().replace(step=9), saved)
    assert not (saved / fm.MANIFEST_NAME).exists()
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match=r"no manifest\.json"):
        kf.checkpoint.load_factor_dir(saved, like=fresh())
    assert not [f for f in os.listdir(saved) if f.endswith(".tmp")]


def test_plans_ranks_and_only_owned_are_checked(saved: Path) -> None:
    layers = kf.register(make_model())
    state = trained()
    with pytest.raises(ValueError, match=r"world_size=4.*no process group"):
        kf.checkpoint.save_factor_dir(state, saved, plan=kf.distributed.make_plan(layers, 4))
    with pytest.raises(ValueError, match="without an initialized process group"):
        kf.checkpoint.save_factor_dir(state, saved, rank=1)
    with pytest.raises(ValueError, match=r"not in plan \['Head', 'body\.0', 'body\.2'\]"):
        kf.checkpoint.save_factor_dir(
            state, saved, plan=kf.distributed.make_plan({"stem.0": (3, 2)}, 1)
        )
    assert (saved / fm.MANIFEST_NAME).exists()  # refused before anything was touched
    comm4 = kf.distributed.make_plan(layers, 4)
    with pytest.raises(ValueError, match="only_owned=True is for MEM_OPT plans"):
        kf.checkpoint.load_factor_dir(saved, like=fresh(), plan=comm4, rank=1, only_owned=True)
    with pytest.raises(ValueError, match="needs the plan"):
        kf.checkpoint.load_factor_dir(saved, like=fresh(), only_owned=True)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        kf.checkpoint.load_factor_dir(saved, like=fresh(), plan=comm4, rank=4)
    with pytest.raises(TypeError):
        kf.checkpoint.save_factor_dir({}, saved)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- 4. resharding


def _plan(layers: kf.LayerTable, world: int, strategy: str) -> kf.distributed.Plan:
    return kf.distributed.make_plan(
        layers, world, grad_worker_fraction=DistributedStrategy[strategy]
    )


def _worker(rank: int, world: int, tmp: str) -> None:
    """4 ranks: train N steps and save each configuration. 2 ranks: load and train M."""
    started = time.perf_counter()
    with (
        gloo_group(rank, world, tmp, store=f"store{world}", timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"world{world}.rank{rank}.error")),
    ):
        joined = time.perf_counter()
        data = torch.load(Path(tmp, "data.pt"), weights_only=False)
        layers = kf.register(make_model())
        result: dict[str, Any] = {"rank": rank, "configs": {}, "joined": joined - started}
        for config in CONFIGS:
            save, resume, include = config
            steps = data[include]
            directory = Path(tmp, _label(config))
            if world == 4:
                plan = _plan(layers, world, save)
                comm = kf.distributed.Communicator(plan)
                state, err = init_state(layers), 0.0
                for s in steps[:N]:
                    out, state = kf.distributed.update_distributed(
                        state,
                        s["grads"],
                        captures=s["local"][rank],
                        plan=plan,
                        comm=comm,
                        update_inverses=SCHEDULES[include],
                        **HYPER,
                    )
                    err = max(err, max_diff(out, s["out"]))
                kf.checkpoint.save_factor_dir(
                    state, directory, plan=plan, include_decompositions=include
                )
                result["configs"][_label(config)] = {"err": err}
            else:
                plan = _plan(layers, world, resume)
                comm = kf.distributed.Communicator(plan)
                only_owned = plan.strategy is DistributedStrategy.MEM_OPT
                like = init_state(layers)
                state = kf.checkpoint.load_factor_dir(
                    directory, like=like, plan=plan, only_owned=only_owned
                )
                read = [n for n in layers if state.layers[n] is not like.layers[n]]
                step0, err = state.step, 0.0
                for s in steps[N:]:
                    out, state = kf.distributed.update_distributed(
                        state,
                        s["grads"],
                        captures=s["local"][rank],
                        plan=plan,
                        comm=comm,
                        update_inverses=SCHEDULES[include],
                        **HYPER,
                    )
                    err = max(err, max_diff(out, s["out"]))
                result["configs"][_label(config)] = {"err": err, "read": read, "step": step0}

        if world == 4:  # one rank failing to write: every rank raises, nothing committed
            real = ff.save_state

            def failing(*args: Any, **kwargs: Any) -> None:
                if rank == 2:
                    raise OSError("rank 2: disk full")
                real(*args, **kwargs)

            ff.save_state = failing  # type: ignore[assignment]
            plan = _plan(layers, world, "MEM_OPT")
            try:
                kf.checkpoint.save_factor_dir(init_state(layers), Path(tmp, "failed"), plan=plan)
            except Exception as e:
                result["failed_save"] = f"{type(e).__name__}: {e}"
            finally:
                ff.save_state = real
            try:  # a plan for another world size
                kf.checkpoint.load_factor_dir(
                    Path(tmp, _label(CONFIGS[0])),
                    like=init_state(layers),
                    plan=_plan(layers, 2, "MEM_OPT"),
                )
            except ValueError as e:
                result["wrong_world"] = str(e)
        result["work"] = time.perf_counter() - joined
        Path(tmp, f"world{world}.rank{rank}.json").write_text(json.dumps(result))


def _spawn(world: int, tmp: Path) -> list[dict[str, Any]]:
    """Train (world 4) or resume (world 2) on fresh gloo ranks; their results."""
    spawn(_worker, world, tmp, errors=f"world{world}.*.error")
    return [json.loads((tmp / f"world{world}.rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("reshard")
    t0 = time.perf_counter()
    data = {include: trajectory(schedule) for include, schedule in SCHEDULES.items()}
    torch.save(data, tmp / "data.pt")
    t1 = time.perf_counter()
    saved = _spawn(4, tmp)
    t2 = time.perf_counter()
    manifests = {_label(c): kf.checkpoint.read_factor_manifest(tmp / _label(c)) for c in CONFIGS}
    resumed = _spawn(2, tmp)
    t3 = time.perf_counter()

    # world 1, in this process: update_distributed under the 1-rank plan, and kf.update
    layers = kf.register(make_model())
    single: dict[str, dict[str, float]] = {}
    for config in CONFIGS:
        include = config[2]
        steps = data[include]
        plan = kf.distributed.make_plan(layers, 1)
        comm = kf.distributed.Communicator(plan)
        a = kf.checkpoint.load_factor_dir(tmp / _label(config), like=init_state(layers), plan=plan)
        b = kf.checkpoint.load_factor_dir(tmp / _label(config), like=init_state(layers))
        err_a = err_b = 0.0
        for s in steps[N:]:
            kw = dict(captures=s["caps"], update_inverses=SCHEDULES[include], **HYPER)
            out, a = kf.distributed.update_distributed(a, s["grads"], plan=plan, comm=comm, **kw)
            err_a = max(err_a, max_diff(out, s["out"]))
            out, b = kf.update(b, s["grads"], **kw)
            err_b = max(err_b, max_diff(out, s["out"]))
        single[_label(config)] = {"update_distributed": err_a, "update": err_b}
    t4 = time.perf_counter()
    work = max(r["work"] for r in saved + resumed)
    print(
        f"\nreference {t1 - t0:.1f} s, 4-rank spawn {t2 - t1:.1f} s, "
        f"2-rank spawn {t3 - t2:.1f} s (at most {work:.1f} s of it after joining the group), "
        f"world 1 {t4 - t3:.1f} s"
    )
    return {
        "tmp": tmp,
        "saved": saved,
        "resumed": resumed,
        "single": single,
        "manifests": manifests,
        "layers": layers,
    }


def test_four_ranks_match_the_reference_before_saving(resharded: dict[str, Any]) -> None:
    for r in resharded["saved"]:
        for label, c in r["configs"].items():
            assert c["err"] < TOL, (r["rank"], label, c["err"])


def test_each_file_is_written_by_its_a_owner(resharded: dict[str, Any]) -> None:
    layers = resharded["layers"]
    for config in CONFIGS:
        manifest = resharded["manifests"][_label(config)]
        plan = _plan(layers, 4, config[0])
        assert manifest["step"] == N and manifest["world_size"] == 4
        assert manifest["strategy"] == config[0]
        assert manifest["plan_fingerprint"] == plan.fingerprint()
        writers = {e["name"]: e["writer"] for e in manifest["layers"]}
        assert writers == {n: plan.layers[n].a_owner for n in layers}
        if config[0] == "MEM_OPT":
            assert sorted(writers.values()) == [0, 1, 2, 3]  # every rank wrote one file


def test_resumed_on_two_ranks_matches_uninterrupted_run(resharded: dict[str, Any]) -> None:
    layers = resharded["layers"]
    print()
    for r in resharded["resumed"]:
        for config in CONFIGS:
            c = r["configs"][_label(config)]
            print(f"rank {r['rank']} {_label(config)}: max |diff| {c['err']:.1e}")
            assert c["step"] == N
            assert c["err"] < TOL, (r["rank"], _label(config), c["err"])
            plan = _plan(layers, 2, config[1])
            if config[1] == "MEM_OPT":  # only_owned: exactly the owned layers were read
                assert c["read"] == [n for n in layers if plan.layers[n].a_owner == r["rank"]]
            else:
                assert c["read"] == list(layers)
    reads = [r["configs"][_label(CONFIGS[0])]["read"] for r in resharded["resumed"]]
    assert reads[0] and reads[1]  # owners differ on 2 ranks too


def test_resumed_in_one_process_matches_uninterrupted_run(resharded: dict[str, Any]) -> None:
    for label, errs in resharded["single"].items():
        assert errs["update_distributed"] < TOL and errs["update"] < TOL, (label, errs)


def test_failure_on_one_rank_fails_every_rank(resharded: dict[str, Any]) -> None:
    for r in resharded["saved"]:
        msg = r["failed_save"]
        if r["rank"] == 2:
            assert msg == "OSError: rank 2: disk full"
        else:
            assert msg.startswith("CheckpointError") and "rank 2: OSError" in msg, msg
    assert not (resharded["tmp"] / "failed" / fm.MANIFEST_NAME).exists()
    for r in resharded["saved"]:
        assert "world_size=2" in r["wrong_world"] and "4 ranks" in r["wrong_world"]
