"""Hugging Face families built from tiny configs (random initialisation, nothing
downloaded) whose classes subclass the supported ones or use parameters outside module
calls: what K-FAC preconditions of each, and that nothing is preconditioned wrongly.

- OPT's learned positions (``OPTLearnedPositionalEmbedding``: positions from the attention
  mask, plus an offset) override ``nn.Embedding.forward`` and make one lookup of their
  weight: preconditioned from the ids looked up (every OPT parameter is; the factors
  against an oracle are in ``tests/test_recorded_embedding.py``); Whisper's decoder
  positions (``WhisperPositionalEmbedding``: rows of the weight by position, whatever the
  token ids) make none: refused on their first call, with a warning naming them, and left
  to AdamW;
- Gemma 3's word embedding (``Gemma3TextScaledWordEmbedding``: the lookup times
  ``sqrt(d)``, tied to the head) is a scaled embedding, and its RMS norms (``1 + weight``)
  are known: every parameter is preconditioned, the tied layer's embedding rows are the
  gradients that reach the weight (float64, against autograd's gradient);
- Mamba's ``conv1d`` and ``dt_proj`` weights are used through ``F.conv1d`` and ``@`` in
  the mixer's forward, its ``D`` as a per-channel scale: their layers are fed by it
  (:mod:`kfac_func.blocks.used_weights`; the factors against the modules called and the
  scale's exact Fisher are in ``tests/test_used_weights.py``);
- T5, OPT and Qwen2-MoE (flattened rows, a broadcast relative-position table) train with
  the recommended ``scaling="fisher"`` recipe.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import kfac_func as kf

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def _ids(n: int, t: int, low: int, high: int, seed: int) -> torch.Tensor:
    return torch.randint(low, high, (n, t), generator=torch.Generator().manual_seed(seed))


def _opt() -> tuple[nn.Module, Any]:
    config = transformers.OPTConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=16, pad_token_id=1, bos_token_id=0,
        eos_token_id=0, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config)

    def batch(seed: int) -> dict[str, torch.Tensor]:
        ids = _ids(3, 8, 2, 40, seed)
        return {"input_ids": ids, "labels": ids}

    return model, batch


def _whisper() -> tuple[nn.Module, Any]:
    config = transformers.WhisperConfig(
        vocab_size=200, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=8, max_target_positions=32, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)

    def batch(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = _ids(3, 6, 40, 200, seed)  # token ids beyond the 32 positions
        return {"input_features": torch.randn(3, 8, 16, generator=g), "labels": ids}

    return model, batch


def _gemma(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    config = transformers.Gemma3TextConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
        sliding_window=4, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(dtype)
    with torch.no_grad():  # norms away from their zero start: 1 + weight is not 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)

    def batch(seed: int) -> dict[str, torch.Tensor]:
        ids = _ids(3, 8, 1, 40, seed)  # not the padding id 0, whose row gets no gradient
        return {"input_ids": ids, "labels": ids}

    return model, batch


def _mamba() -> tuple[nn.Module, Any]:
    config = transformers.MambaConfig(
        vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
        conv_kernel=3, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config)

    def batch(seed: int) -> dict[str, torch.Tensor]:
        ids = _ids(3, 8, 0, 40, seed)
        return {"input_ids": ids, "labels": ids}

    return model, batch


def _train(model: nn.Module, batch: Any, steps: int, **kw: Any) -> tuple[kf.KFAC, list[Any]]:
    opt = kf.KFAC(model, lr=1e-3, damping=0.01, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            model(**batch(step)).loss.backward()
            opt.step()
    return opt, [w for w in caught if issubclass(w.category, (UserWarning, RuntimeWarning))]


def _others(opt: kf.KFAC) -> set[int]:
    others = opt.others_optimizer
    return set() if others is None else {id(p) for g in others.param_groups for p in g["params"]}


def test_opt_every_parameter_is_preconditioned_its_positions_from_their_lookup() -> None:
    model, batch = _opt()
    table = kf.register(model)
    assert table["model.decoder.embed_positions"].kind == "recorded_embedding"
    opt, caught = _train(model, batch, steps=2)
    assert not caught, [str(w.message) for w in caught]
    assert opt.others_optimizer is None
    pre = opt.preconditioner
    assert not pre.layers.skipped and not pre.demoted
    _, rest = pre.layers.split_parameters(model)
    assert not [p for p in rest if p.requires_grad]


def test_whisper_positions_that_slice_the_weight_go_to_adamw() -> None:
    cls = "WhisperPositionalEmbedding"
    model, batch = _whisper()
    opt, caught = _train(model, batch, steps=2)
    refused = [w for w in caught if issubclass(w.category, kf.FallbackWarning)]
    assert len(refused) == 1, [str(w.message) for w in caught]
    message = str(refused[0].message)
    assert f"{cls} overrides forward: its output is not weight[ids]" in message, message
    assert "uses the weight otherwise" in message, message
    name = "model.decoder.embed_positions"
    pre = opt.preconditioner
    assert name not in pre.layers and cls in pre.layers.skipped[name]
    positions = model.get_parameter(f"{name}.weight")
    assert id(positions) in _others(opt)
    # every other parameter that requires a gradient is preconditioned
    mine, rest = pre.layers.split_parameters(model)
    left = {n for n, p in model.named_parameters() if p.requires_grad and any(p is q for q in rest)}
    assert left == {f"{name}.weight"}
    assert {id(p) for p in opt.kfac_optimizer.param_groups[0]["params"]} == {id(p) for p in mine}


def test_gemma3_every_parameter_is_preconditioned_without_a_warning() -> None:
    model, batch = _gemma()
    table = kf.register(model)
    head = table["lm_head"]
    assert head.kind == "tied" and head.option("embedding_scale") == pytest.approx(4.0)
    norms = [s for s in table.values() if s.kind == "rms_norm"]
    assert len(norms) == 13 and all(s.option("offset") == 1.0 for s in norms)
    opt, caught = _train(model, batch, steps=2)
    assert not caught, [str(w.message) for w in caught]
    assert opt.others_optimizer is None
    assert not opt.preconditioner.layers.skipped


def test_gemma3_tied_rows_reproduce_the_shared_weights_gradient() -> None:
    """The embedding's use of the tied weight is ``sqrt(d) · W[x]``: its rows (the
    gradients that reach ``W``, ``sqrt(d)`` times the module's output-gradients) and the
    head's add up to autograd's gradient of the shared weight (float64)."""
    model, batch = _gemma(F64)
    table = kf.register(model)
    spec = table["lm_head"]
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(
        model, params, (), lambda out: out.loss, layers=table, kwargs=batch(0)
    )
    calls = caps.layers["lm_head"]
    total = torch.zeros(spec.weight_shape, dtype=F64)
    uses = []
    for x, r in zip(calls.inputs, calls.output_grads):
        rows = spec.block.example_rows(spec, x, r)
        assert rows is not None
        total += torch.einsum("ntv,ntd->vd", rows[1], rows[0])
        uses.append(spec.block.is_embedding_call(x, r))
    assert sorted(uses) == [False, True]
    torch.testing.assert_close(total, grads[spec.weight], rtol=1e-9, atol=1e-12)


def test_mamba_conv1d_dt_proj_and_d_are_preconditioned_from_the_mixers_forward() -> None:
    """The mixer applies ``conv1d`` with ``F.conv1d`` on its weight, ``dt_proj`` as
    ``weight @ x`` with the bias added in the scan, and its own ``D`` as a per-channel
    scale: all three are fed by the mixer's forward, without a warning (the old code
    warned that ``conv1d`` and ``dt_proj`` got no statistics and left them and ``D`` to
    AdamW); only ``A_log`` (inside ``exp``) goes to AdamW."""
    model, batch = _mamba()
    opt, caught = _train(model, batch, steps=3)
    assert not caught, [str(w.message) for w in caught]
    mixer = "backbone.layers.0.mixer"
    pre = opt.preconditioner
    assert sorted(pre.layers) == [
        f"{mixer}.D", f"{mixer}.conv1d", f"{mixer}.dt_proj", f"{mixer}.in_proj",
        f"{mixer}.out_proj", f"{mixer}.x_proj", "backbone.layers.0.norm", "backbone.norm_f",
        "lm_head",
    ]  # fmt: skip
    assert all(ls.factor_updates == 3 for ls in pre.state.layers.values())
    assert pre.layers[f"{mixer}.dt_proj"].bias == f"{mixer}.dt_proj.bias"
    for name in (f"{mixer}.conv1d", f"{mixer}.dt_proj", f"{mixer}.D"):
        ls = pre.state.layers[name]
        assert pre.layers[name].module == mixer
        assert all(bool(f.abs().sum() > 0) for f in (ls.a_factor, ls.g_factor)), name
    others = {n for n, p in model.named_parameters() if id(p) in _others(opt)}
    assert others == {f"{mixer}.A_log"}, others


@pytest.mark.parametrize("family", ["T5", "OPT", "Qwen2-MoE"])
def test_recommended_recipe_runs_on_models_with_flattened_or_broadcast_inputs(family: str) -> None:
    """OPT's MLP and Qwen2-MoE's shared expert see ``(B·T, d)`` rows, T5's relative
    attention bias a ``(T, T)`` table: under ``scaling="fisher"`` the flattened rows take
    the other layers' batch size and the table is left to AdamW with its reason (the old
    code raised ``BatchSizeError`` at the first step)."""
    from fixture_families import build

    model, batch = build(family)
    opt, _ = _train(model, batch, steps=2, scaling="fisher", eigenbasis_moments=True)
    pre = opt.preconditioner
    assert pre.steps == 2
    tables = {n: why for n, why in pre.layers.skipped.items() if "relative-position" in why}
    if family == "T5":
        assert set(tables) == {
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias",
        }
        assert all("broadcast over the batch" in why for why in tables.values())
        for name in tables:
            assert id(model.get_parameter(f"{name}.weight")) in _others(opt)
    else:
        assert not tables
