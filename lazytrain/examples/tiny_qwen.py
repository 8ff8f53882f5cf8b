"""The built-in default: a small Qwen2-style decoder (4 layers, hidden 128) for the shipped corpus.

Built from a config, so no download is needed; the vocabulary matches the shipped tokenizer (512).
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BATCH, SEQ = 8, 64


def config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_model() -> torch.nn.Module:
    return Qwen2ForCausalLM(config())


def example_batch() -> dict:
    """position_ids keep packed documents and examples apart (NOTE: [Packing] in lazytrain/train/packing.py)."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": ids.clone()}
