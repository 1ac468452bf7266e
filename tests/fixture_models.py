"""Model code this project did not write, as users bring it, built from configs (random
initialisation; nothing is downloaded), for the tests of :mod:`test_real_models`.

- Hugging Face ``transformers``: GPT-2 (``Conv1D`` projections, learned positions, tied
  head), Llama (RoPE, ``LlamaRMSNorm``, SDPA, grouped-query attention, untied and tied
  heads) and BERT (masked LM, token types, a head tied to the word embedding);
- a nanoGPT-style ``GPT`` written here in nanoGPT's shape: its own ``LayerNorm`` class with
  an optional bias and no ``eps`` attribute, ``c_attn``/``c_proj`` linears,
  ``scaled_dot_product_attention``, a head tied to ``wte``, ``forward(idx, targets)``
  returning ``(logits, loss)``.

Every model is called the way its users call it: Hugging Face models with keyword
arguments (``model(**batch)``), the nanoGPT model as ``model(idx=x, targets=y)``. Each
fixture is a :class:`Fixture`: a builder (same weights on every call), a batch maker and
the loss of the model's output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

V, T, D = 23, 8, 16
"""Vocabulary, context and width of every fixture."""


@dataclass(frozen=True)
class Fixture:
    """A model as users bring it.

    Attributes:
        name: the fixture's id.
        build: ``dtype -> model``; the same weights on every call (seeded).
        kinds: ``{class: kind}`` for :func:`kfac_func.register` (classes the library does
            not recognise by itself), or None.
        loss: ``model output -> scalar loss`` (the mean over the batch's tokens).
    """

    name: str
    build: Callable[[torch.dtype], nn.Module]
    kinds: dict[type, Any] | None
    loss: Callable[[Any], torch.Tensor]

    def batch(self, step: int, n: int) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model for ``n`` sequences of step ``step``."""
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, V, (n, T), generator=g)
        if self.name.startswith("nanogpt"):
            return {"idx": ids, "targets": torch.roll(ids, -1, dims=1)}
        if self.name == "bert":
            types = torch.randint(0, 2, (n, T), generator=g)
            return {"input_ids": ids, "token_type_ids": types, "labels": ids}
        return {"input_ids": ids, "labels": ids}


# --- nanoGPT-style ------------------------------------------------------------------


class LayerNorm(nn.Module):
    """nanoGPT's norm: a weight, an optional bias, ``eps`` fixed inside the forward."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.c_proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(d, bias)
        self.attn = CausalSelfAttention(d, heads, bias)
        self.ln_2 = LayerNorm(d, bias)
        self.mlp = MLP(d, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's ``GPT`` in small: ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, layers: int = 2, heads: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(V, D),
                "wpe": nn.Embedding(T, D),
                "h": nn.ModuleList(Block(D, heads, bias) for _ in range(layers)),
                "ln_f": LayerNorm(D, bias),
            }
        )
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


def _nanogpt(bias: bool) -> Callable[[torch.dtype], nn.Module]:
    def build(dtype: torch.dtype) -> nn.Module:
        torch.manual_seed(0)
        return GPT(bias=bias).to(dtype)

    return build


# --- Hugging Face ---------------------------------------------------------------------


def _gpt2(dtype: torch.dtype) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=D, n_head=2, n_positions=T, vocab_size=V, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def _llama(tied: bool) -> Callable[[torch.dtype], nn.Module]:
    def build(dtype: torch.dtype) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=2, hidden_size=D, intermediate_size=2 * D,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
            max_position_embeddings=T, tie_word_embeddings=tied, bos_token_id=0,
            eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(dtype)

    return build


def _bert(dtype: torch.dtype) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2, hidden_size=D, intermediate_size=2 * D, num_attention_heads=2,
        vocab_size=V, max_position_embeddings=T, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return BertForMaskedLM(config).to(dtype)


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def _nanogpt_loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[1]


def fixtures() -> list[Fixture]:
    """Every fixture model; the Hugging Face ones need ``transformers``."""
    return [
        Fixture("gpt2", _gpt2, None, _hf_loss),
        Fixture("llama", _llama(tied=False), None, _hf_loss),
        Fixture("llama-tied", _llama(tied=True), None, _hf_loss),
        Fixture("bert", _bert, None, _hf_loss),
        Fixture("nanogpt", _nanogpt(bias=True), {LayerNorm: "layer_norm"}, _nanogpt_loss),
        Fixture("nanogpt-nobias", _nanogpt(bias=False), {LayerNorm: "layer_norm"}, _nanogpt_loss),
    ]


FIXTURES = {f.name: f for f in fixtures()}
