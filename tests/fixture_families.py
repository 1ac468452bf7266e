"""Hugging Face families built from tiny configs (random initialisation, nothing
downloaded), each with a batch maker that calls the model as Hugging Face trains it
(keyword arguments and labels): the models of ``tests/test_families.py`` and of
``benchmarks/families.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Batch = Callable[[int], dict[str, torch.Tensor]]

N, T = 3, 8


def _ids(low: int, high: int, seed: int, n: int = N, t: int = T) -> torch.Tensor:
    return torch.randint(low, high, (n, t), generator=torch.Generator().manual_seed(seed))


def _lm(ids_low: int = 1, vocab: int = 40) -> Batch:
    def batch(seed: int) -> dict[str, torch.Tensor]:
        ids = _ids(ids_low, vocab, seed)
        return {"input_ids": ids, "labels": ids}

    return batch


def gpt_neox() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.GPTNeoXConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, pad_token_id=0, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return tr.GPTNeoXForCausalLM(config), _lm()


def t5() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip

    def batch(seed: int) -> dict[str, torch.Tensor]:
        return {"input_ids": _ids(2, 40, seed), "labels": _ids(2, 40, seed + 1000, t=6)}

    return tr.T5ForConditionalGeneration(config), batch


def vit() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=5,
    )  # fmt: skip

    def batch(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            "pixel_values": torch.randn(N, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 5, (N,), generator=g),
        }

    return tr.ViTForImageClassification(config), batch


def whisper() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.WhisperConfig(
        vocab_size=200, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=8, max_target_positions=32, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip

    def batch(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            "input_features": torch.randn(N, 8, 16, generator=g),
            "labels": _ids(40, 200, seed, t=6),
        }

    return tr.WhisperForConditionalGeneration(config), batch


def gemma3() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.Gemma3TextConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
        sliding_window=4, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tr.Gemma3ForCausalLM(config), _lm()


def qwen2_moe() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.Qwen2MoeConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tr.Qwen2MoeForCausalLM(config), _lm()


def mixtral() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.MixtralConfig(
        vocab_size=40, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return tr.MixtralForCausalLM(config), _lm()


def mamba() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.MambaConfig(
        vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
        conv_kernel=3, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tr.MambaForCausalLM(config), _lm()


def modernbert() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.ModernBertConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, cls_token_id=0, sep_token_id=0, global_attn_every_n_layers=2,
        local_attention=4,
    )  # fmt: skip
    return tr.ModernBertForMaskedLM(config), _lm()


def phi3() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.Phi3Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tr.Phi3ForCausalLM(config), _lm()


def opt() -> tuple[nn.Module, Batch]:
    import transformers as tr

    config = tr.OPTConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=16, pad_token_id=1, bos_token_id=0,
        eos_token_id=0, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return tr.OPTForCausalLM(config), _lm(ids_low=2)


FAMILIES: dict[str, Callable[[], tuple[nn.Module, Batch]]] = {
    "GPT-NeoX": gpt_neox,
    "T5": t5,
    "ViT": vit,
    "Whisper": whisper,
    "Gemma 3": gemma3,
    "Qwen2-MoE": qwen2_moe,
    "Mixtral": mixtral,
    "Mamba": mamba,
    "ModernBERT": modernbert,
    "Phi-3": phi3,
    "OPT": opt,
}


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, Any]:
    """The family's model (seeded, in ``dtype``) and its batch maker."""
    torch.manual_seed(seed)
    model, batch = FAMILIES[family]()
    return model.to(dtype), batch
