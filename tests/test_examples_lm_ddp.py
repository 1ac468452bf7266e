"""The transformer language-model example and the DDP example, on tiny settings.

Fast tests import the example scripts and check their pieces (argument parsing, the
strategy mapping, the data split, which layers K-FAC preconditions). Slow tests run the
scripts end to end in subprocesses (``ddp_train.py`` under ``torch.distributed.run`` on 2
gloo ranks) and check the table they print and the CSV and PNG they write.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_curves(prefix: Path, runs: list[str], epochs: int, metrics: list[str]) -> list[dict]:
    """The CSV has one row per run and epoch with finite metrics; the PNG is a PNG."""
    rows = read_csv(prefix.with_suffix(".csv"))
    assert [(r["optimizer"], int(r["epoch"])) for r in rows] == [
        (name, e) for name in runs for e in range(1, epochs + 1)
    ]
    for r in rows:
        for m in metrics:
            assert math.isfinite(float(r[m])), (m, r)
    assert prefix.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    return rows


# --------------------------------------------------------------------------- fast


def test_help_of_both_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for name, flag in (("transformer_lm", "--kfac-skip"), ("ddp_train", "--strategy")):
        with pytest.raises(SystemExit) as exit_info:
            load_example(name).parse_args(["--help"])
        assert exit_info.value.code == 0
        assert flag in capsys.readouterr().out


def test_unknown_optimizer_is_refused() -> None:
    for name in ("transformer_lm", "ddp_train"):
        with pytest.raises(SystemExit) as exit_info:
            load_example(name).parse_args(["--optimizers", "sgd,lbfgs"])
        assert exit_info.value.code == 2


def test_strategy_flags_map_to_grad_worker_fractions() -> None:
    fraction = load_example("ddp_train").grad_worker_fraction
    assert [fraction(s, 4) for s in ("comm-opt", "mem-opt", "hybrid-opt")] == [1.0, 0.25, 0.5]
    assert fraction("mem-opt", 1) == 1.0


def test_char_data_split_and_batches() -> None:
    lm = load_example("transformer_lm")
    data = lm.CharData(test_fraction=0.1)
    total = len(data.train) + len(data.test)
    assert total > 400_000  # the help text of the standard library
    assert abs(len(data.test) / total - 0.1) < 1e-3
    assert int(max(data.train.max(), data.test.max())) < data.vocab
    x, y = data.batch(5, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    xt, yt = data.test_windows(16, 7)
    assert torch.equal(xt, data.test_windows(16, 7)[0])  # the same windows every epoch
    assert torch.equal(xt[:, 1:], yt[:, :-1])


def test_lm_kfac_preconditions_every_layer_by_default() -> None:
    lm = load_example("transformer_lm")
    model = lm.CharTransformer(vocab=11, context=8, d_model=16, layers=2, heads=2)
    pre = lm.kf.KFACPreconditioner(model, skip_layers=lm.parse_args([]).kfac_skip)
    owners = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters()}
    assert set(pre.layers) == owners
    assert not pre.layers.skipped
    kinds = {s.kind for s in pre.layers.values()}
    assert kinds == {"linear", "embedding", "layer_norm"}


def test_lm_torch_variant_preconditions_every_parameter() -> None:
    lm = load_example("transformer_lm")
    model = lm.TorchCharTransformer(vocab=11, context=8, d_model=16, layers=2, heads=2)
    pre = lm.kf.KFACPreconditioner(model, skip_layers=lm.parse_args(["--model", "torch"]).kfac_skip)
    covered = {p for spec in pre.layers.values() for p in spec.param_names()}
    assert covered == {n for n, _ in model.named_parameters()}
    assert {s.kind for s in pre.layers.values()} == {
        "linear",
        "embedding",
        "layer_norm",
        "attention",
    }
    x = torch.randint(0, 11, (3, 8))
    lm.lm_loss(model(x), torch.randint(0, 11, (3, 8))).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    assert all(not torch.equal(before[n], p.grad) for n, p in model.named_parameters())


def test_lm_kfac_linear_only_preconditions_every_linear_and_skips_the_rest() -> None:
    lm = load_example("transformer_lm")
    args = lm.parse_args(["--kfac-linear-only"])
    model = lm.CharTransformer(vocab=11, context=8, d_model=16, layers=2, heads=2)
    pre = lm.kf.KFACPreconditioner(model, skip_layers=args.kfac_skip)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(pre.layers) == linears
    assert {"blocks.1.attn.query", "blocks.1.attn.value", "blocks.0.fc2", "head"} <= linears
    # one step runs and changes the gradients of the registered layers only
    x = torch.randint(0, 11, (3, 8))
    lm.lm_loss(model(x), torch.randint(0, 11, (3, 8))).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    for n, p in model.named_parameters():
        changed = not torch.equal(before[n], p.grad)
        assert changed == (n.rsplit(".", 1)[0] in linears), n


def test_lm_attention_is_causal() -> None:
    lm = load_example("transformer_lm")
    torch.manual_seed(0)
    model = lm.CharTransformer(vocab=11, context=8, d_model=16, layers=1, heads=2).eval()
    x = torch.randint(0, 11, (2, 8))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % 11  # change the future only
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :5], model(y)[:, :5], atol=1e-6)
        assert not torch.allclose(model(x)[:, 5:], model(y)[:, 5:])


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_transformer_lm_runs(tmp_path: Path) -> None:
    prefix = tmp_path / "lm"
    proc = run(
        [
            sys.executable,  # the warnings kfac_func raises are errors
            str(EXAMPLES.parent / "tests" / "library_warnings.py"),
            str(EXAMPLES / "transformer_lm.py"),
            *("--epochs", "2", "--steps", "3", "--batch-size", "4", "--context", "16"),
            *("--d-model", "32", "--heads", "2", "--layers", "1", "--test-windows", "8"),
            *("--out", str(prefix)),
        ],
        cwd=tmp_path,
    )
    runs = ["sgd", "adam", "kfac", "kfac-moments", "kfac-default"]
    rows = check_curves(prefix, runs, 2, ["train_loss", "test_loss", "test_bits_per_char"])
    for r in rows:
        assert float(r["test_bits_per_char"]) == pytest.approx(float(r["test_loss"]) / math.log(2))
        assert 0 < float(r["train_loss"]) < 10
    lines = proc.stdout.splitlines()
    table = [line.split() for line in lines[lines.index("final epoch") + 2 :][: len(runs)]]
    assert [t[0] for t in table] == runs
    # the printed final losses are the CSV's last rows
    last = {r["optimizer"]: r for r in rows if r["epoch"] == "2"}
    for t in table:
        assert float(t[2]) == pytest.approx(float(last[t[0]]["train_loss"]), abs=1e-4)


DDP_FLAGS = ["--epochs", "1", "--samples", "192", "--batch-size", "32"]
DDP_METRICS = ["train_loss", "test_loss", "test_accuracy"]


@pytest.mark.slow
def test_ddp_train_two_ranks_comm_opt_and_mem_opt_agree(tmp_path: Path) -> None:
    """Under torch.distributed.run on 2 gloo ranks both strategies run, rank 0 alone
    prints and writes, and the two strategies train the same numbers (they distribute the
    same computation differently)."""
    prefix = tmp_path / "ddp"
    proc = run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", str(EXAMPLES / "ddp_train.py"), *DDP_FLAGS),
            *("--strategy", "comm-opt,mem-opt", "--out", str(prefix)),
        ],
        cwd=tmp_path,
    )
    out = proc.stdout
    assert "2 rank(s) (backend gloo" in out
    assert "KAISA plan: world 2, COMM_OPT" in out
    assert "KAISA plan: world 2, MEM_OPT" in out
    assert out.count("final epoch") == 1  # only rank 0 prints
    rows = check_curves(prefix, ["sgd", "kfac comm-opt", "kfac mem-opt"], 1, DDP_METRICS)
    sgd, comm, mem = rows
    for m in DDP_METRICS:
        assert float(comm[m]) == pytest.approx(float(mem[m]), rel=1e-4, abs=1e-6), (comm, mem)
    assert float(comm["train_loss"]) != float(sgd["train_loss"])  # K-FAC changed the steps
    assert all(0 <= float(r["test_accuracy"]) <= 1 for r in rows)


@pytest.mark.slow
def test_ddp_train_single_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without torchrun the script trains on one process (no process group)."""
    prefix = tmp_path / "single"
    ddp = load_example("ddp_train")
    flags = ["--strategy", "hybrid-opt", "--threads", "1", "--out", str(prefix)]
    threads = torch.get_num_threads()
    try:
        ddp.main([*DDP_FLAGS, "--epochs", "2", *flags])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "1 rank(s) (backend none" in out
    assert "KAISA plan: world 1, COMM_OPT" in out  # hybrid-opt on one rank
    check_curves(prefix, ["sgd", "kfac hybrid-opt"], 2, DDP_METRICS)
