"""`kfac_func.KFAC`, the optimizer face: equal to the manual preconditioner + optimizers
loop bit for bit, driven by schedulers, resumable, and accepted by Hugging Face's Trainer,
Lightning and accelerate."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf

SKIP = ["Embedding"]
KFAC_ARGS: dict[str, Any] = {
    "skip_layers": SKIP,
    "scaling": "fisher",
    "damping": 0.01,
    "factor_update_steps": 2,
    "inv_update_steps": 3,
    "kl_clip": 0.01,
}
MOMENTS: dict[str, Any] = {
    "skip_layers": SKIP,
    "scaling": "fisher",
    "damping": 0.01,
    "factor_update_steps": 2,
    "inv_update_steps": 3,
    "kl_clip": None,
    "eigenbasis_moments": True,
    "moment_beta1": 0.9,
    "moment_beta2": 0.95,
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(16, 8), nn.Flatten(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)
    )


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 16, (24, 4), generator=g)
        out.append((x, x.sum(1) % 5))
    return out


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _schedule(step: int) -> float:
    return 0.5 ** (step // 2) if step else 0.3


def _manual(
    steps: int, kfac_args: dict[str, Any], sgd_args: dict[str, Any], lr: float
) -> tuple[nn.Module, kf.KFACPreconditioner]:
    """The documented recipe by hand: preconditioner, SGD on its parameters, AdamW on the
    rest, one LambdaLR on each, the preconditioner's lr read from SGD's group."""
    model = _model()
    pre_box: list[torch.optim.Optimizer] = []
    pre = kf.KFACPreconditioner(
        model, lr=lambda k: pre_box[0].param_groups[0]["lr"], **with_settings(**kfac_args)
    )
    mine, rest = pre.layers.split_parameters(model)
    sgd = torch.optim.SGD(mine, lr=lr, **sgd_args)
    adamw = torch.optim.AdamW(rest, lr=lr)
    pre_box.append(sgd)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _schedule) for o in (sgd, adamw)]
    for batch in _batches(steps):
        sgd.zero_grad()
        adamw.zero_grad()
        _loss(model, batch).backward()
        pre.step()
        sgd.step()
        adamw.step()
        for s in scheds:
            s.step()
    return model, pre


def _face(
    model: nn.Module, kfac_args: dict[str, Any], sgd_args: dict[str, Any], lr: float
) -> tuple[kf.KFAC, torch.optim.lr_scheduler.LRScheduler]:
    opt = kf.KFAC(model, recipe="kfac-pytorch", lr=lr, base_kwargs=sgd_args, **kfac_args)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[float]:
    losses = []
    for batch in batches:

        def closure(batch: tuple[torch.Tensor, torch.Tensor] = batch) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        sched.step()
    return losses


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kfac_args", "sgd_args", "lr"),
    [(KFAC_ARGS, {"momentum": 0.9}, 0.1), (MOMENTS, {}, 3e-3)],
    ids=["kl_clip+momentum", "eigenbasis_moments"],
)
def test_equals_the_manual_loop_bit_for_bit(
    kfac_args: dict[str, Any], sgd_args: dict[str, Any], lr: float
) -> None:
    steps = 7
    manual, pre = _manual(steps, kfac_args, sgd_args, lr)
    model = _model()
    opt, sched = _face(model, kfac_args, sgd_args, lr)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [type(o) for o in opt.optimizers] == [torch.optim.SGD, torch.optim.AdamW]
    _train(model, opt, sched, _batches(steps))
    assert _same(model, manual)
    assert opt.preconditioner.steps == pre.steps == steps
    for name, ls in pre.state.layers.items():
        mine = opt.preconditioner.state.layers[name]
        assert mine.factor_updates == ls.factor_updates == 4
        assert torch.equal(mine.a_factor, ls.a_factor) and torch.equal(mine.g_factor, ls.g_factor)


def test_kfac_lr_follows_the_schedule_unless_given() -> None:
    model = _model()
    opt = kf.KFAC(model, recipe="kfac-pytorch", lr=0.2, **KFAC_ARGS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pre = opt.preconditioner
    seen = []
    for batch in _batches(3):
        seen.append(pre._value(pre.lr))
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        sched.step()
    assert seen == [0.2, 0.1, 0.05]
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.025]
    fixed = kf.KFAC(_model(), recipe="kfac-pytorch", lr=0.2, kfac_lr=0.7, **KFAC_ARGS)
    assert fixed.preconditioner.lr == 0.7


def test_hugging_face_schedule_drives_both_parts() -> None:
    transformers = pytest.importorskip("transformers")
    opt = kf.KFAC(
        _model(),
        recipe="kfac-pytorch",
        lr=1e-2,
        others_kwargs={"lr": 1e-3, "weight_decay": 0.0},
        **KFAC_ARGS,
    )
    assert opt.others_optimizer is not None
    assert opt.others_optimizer.param_groups[0]["weight_decay"] == 0.0
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, 6)
    lrs = []
    for _ in range(6):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        _loss(opt.preconditioner.model, _batches(1)[0]).backward()
        opt.step()
        sched.step()
    assert lrs[0] == [0.0, 0.0]
    assert lrs[2] == pytest.approx([1e-2, 1e-3])
    assert lrs[4] == pytest.approx([5e-3, 5e-4])
    # the groups are the base optimizers' own dicts
    assert opt.param_groups[0] is opt.kfac_optimizer.param_groups[0]
    assert opt.param_groups[1] is opt.others_optimizer.param_groups[0]


@pytest.mark.parametrize(
    ("kfac_args", "sgd_args"),
    [(KFAC_ARGS, {"momentum": 0.9}), (MOMENTS, {})],
    ids=["kl_clip+momentum", "eigenbasis_moments"],
)
@pytest.mark.parametrize("cut", [3, 4])
def test_state_dict_round_trip_resumes_bit_for_bit(
    kfac_args: dict[str, Any], sgd_args: dict[str, Any], cut: int
) -> None:
    """Cut after 3 steps (the next step updates factors, not decompositions) or 4."""
    batches = _batches(8)
    straight = _model()
    opt, sched = _face(straight, kfac_args, sgd_args, 0.05)
    _train(straight, opt, sched, batches)

    first = _model()
    opt1, sched1 = _face(first, kfac_args, sgd_args, 0.05)
    _train(first, opt1, sched1, batches[:cut])
    buffer = io.BytesIO()
    torch.save(
        {"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict()},
        buffer,
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["opt"]) == {"state", "param_groups"}
    assert saved["opt"]["param_groups"][0]["kfac"]["steps"] == cut

    resumed = _model(seed=5)  # other weights: everything must come from the checkpoint
    opt2, sched2 = _face(resumed, kfac_args, sgd_args, 0.05)
    groups = list(opt2.param_groups)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert all(a is b for a, b in zip(groups, opt2.param_groups, strict=True))
    assert opt2.param_groups[0] is opt2.kfac_optimizer.param_groups[0]
    assert len(opt2.state) == len(opt1.state) > 0
    _train(resumed, opt2, sched2, batches[cut:])
    assert _same(resumed, straight)
    assert opt2.preconditioner.steps == 8


def test_load_state_dict_refuses_a_foreign_dict_and_changes_nothing() -> None:
    model = _model()
    opt, sched = _face(model, KFAC_ARGS, {"momentum": 0.9}, 0.05)
    _train(model, opt, sched, _batches(2))
    before = opt.state_dict()
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="no 'kfac' part"):
        opt.load_state_dict(plain.state_dict())
    other = kf.KFAC(
        model, recipe="kfac-pytorch", lr=0.05, skip_layers=[*SKIP, "4"], others=None, damping=0.1
    )
    other_sd = other.state_dict()
    other_sd["param_groups"][0]["kfac"] = before["param_groups"][0]["kfac"]
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(other_sd)
    after = opt.state_dict()
    for groups in (after["param_groups"], before["param_groups"]):
        groups[0].pop("kfac")
    assert after["param_groups"] == before["param_groups"]
    assert opt.preconditioner.steps == 2


def test_closure_hooks_zero_grad_and_state_view() -> None:
    model = _model()
    opt = kf.KFAC(model, recipe="kfac-pytorch", lr=0.05, base_kwargs={"momentum": 0.9}, **KFAC_ARGS)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(f"pre {o is opt}"))
    opt.register_step_post_hook(lambda o, a, k: calls.append(f"post {o.preconditioner.steps}"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(f"sd {sorted(sd)}"))
    batch = _batches(1)[0]

    def closure() -> torch.Tensor:
        calls.append(f"closure grad={torch.is_grad_enabled()}")
        opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        return loss

    with torch.no_grad():  # as trainers may call step
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    opt.state_dict()
    assert calls == [
        "pre True",
        "closure grad=True",
        "post 1",
        "sd ['param_groups', 'state']",
    ]
    assert opt.step() is None  # without a closure: the gradients already there
    params = list(model.parameters())
    assert len(opt.state) == 5 and set(opt.state) == {p for p in params}
    assert "momentum_buffer" in opt.state[params[2]] and "exp_avg" in opt.state[params[0]]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    with pytest.raises(KeyError):
        opt.state[torch.zeros(1)]


def test_add_param_group_goes_to_the_others_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    opt = kf.KFAC(model, recipe="kfac-pytorch", lr=0.1, damping=0.01)
    assert opt.others_optimizer is None and len(opt.param_groups) == 1
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert isinstance(opt.others_optimizer, torch.optim.AdamW)
    assert opt.param_groups[1] is opt.others_optimizer.param_groups[0]
    assert opt.param_groups[1]["lr"] == 0.5
    more = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": more})
    assert len(opt.others_optimizer.param_groups) == 2 and len(opt.param_groups) == 3
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})
    x = torch.randn(8, 4)
    opt.zero_grad()
    (model(x).sum() + extra.sum() + more.sum()).backward()
    opt.step()
    assert not torch.equal(extra, torch.ones(3)) and not torch.equal(more, torch.ones(2))
    assert opt.state_dict()["param_groups"][2]["params"] == [3]


# --------------------------------------------------------------------------- trainers


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences of token ids with a pattern to learn, as a Hugging Face dataset of dicts."""

    def __init__(self, n: int = 64, length: int = 32, vocab: int = 48) -> None:
        self.rows = [(torch.arange(length) * (i % 5 + 1) + i) % vocab for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _updates(opt: kf.KFAC) -> list[int]:
    return [ls.factor_updates for ls in opt.preconditioner.state.layers.values()]


@pytest.mark.slow  # 2 s alone, up to 15 s on a busy machine
def test_hugging_face_trainer_trains_with_kfac(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=32,
        vocab_size=48,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied head is skipped with a warning (for now)
        opt = kf.KFAC(
            model,
            recipe="kfac-pytorch",
            lr=3e-3,
            damping=0.01,
            factor_update_steps=2,
            inv_update_steps=4,
            **{k: MOMENTS[k] for k in ("kl_clip", "eigenbasis_moments", "moment_beta1")},
        )
    sched = transformers.get_linear_schedule_with_warmup(opt, 3, 30)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=5,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, sched)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert opt.preconditioner.steps == 30
    assert set(_updates(opt)) == {15}  # every registered layer, every second step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)  # the schedule ran to its end


def test_lightning_trainer_steps_with_the_closure() -> None:
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> Any:
            self.opt = kf.KFAC(
                self.net, recipe="kfac-pytorch", lr=0.1, base_kwargs={"momentum": 0.9}, **KFAC_ARGS
            )
            sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=10, gamma=0.5)
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Module()
    module.losses = []
    batches = _batches(2) * 10  # a loss that must fall
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    opt = module.opt
    assert opt.preconditioner.steps == 20 and set(_updates(opt)) == {10}
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # the scheduler ran
    first, last = sum(module.losses[:5]) / 5, sum(module.losses[-5:]) / 5
    assert last < first, module.losses
    # the same as by hand: closure steps of the same optimizer on the same batches
    model = _model()
    manual = kf.KFAC(
        model, recipe="kfac-pytorch", lr=0.1, base_kwargs={"momentum": 0.9}, **KFAC_ARGS
    )
    sched = torch.optim.lr_scheduler.StepLR(manual, step_size=10, gamma=0.5)
    _train(model, manual, sched, batches)
    assert _same(model, module.net)


def test_accelerate_prepare_keeps_the_hooked_model() -> None:
    accelerate = pytest.importorskip("accelerate")
    batches = _batches(6)
    model = _model()
    opt, sched = _face(model, KFAC_ARGS, {"momentum": 0.9}, 0.1)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    accelerator = accelerate.Accelerator(cpu=True)
    prepared, popt, ploader = accelerator.prepare(model, opt, loader)
    assert isinstance(popt, accelerate.optimizer.AcceleratedOptimizer)
    assert popt.optimizer is opt and prepared is model  # one CPU process: the same objects
    assert popt.param_groups is opt.param_groups
    assert opt.param_groups[0] is opt.kfac_optimizer.param_groups[0]  # prepare's round trip
    for batch in ploader:
        popt.zero_grad()
        accelerator.backward(_loss(prepared, batch))
        popt.step()
        sched.step()
    assert opt.preconditioner.steps == 6 and set(_updates(opt)) == {3}
    reference = _model()
    ropt, rsched = _face(reference, KFAC_ARGS, {"momentum": 0.9}, 0.1)
    _train(reference, ropt, rsched, batches)
    assert _same(model, reference)
