"""A pretrained model saved as `save_pretrained` writes it, for the tests that load one per rank
(tests/trainer/test_distributed.py, tests/trainer/test_lowbit.py)."""

from __future__ import annotations

from pathlib import Path

import torch

# hidden 1024, MLP 2048, 4 layers, 8 heads (4 for k/v): 37.8 M parameters, 151 MB in fp32;
# the largest tensor (an MLP projection) 8 MB; vocabulary of the demo tokenizer, tied embeddings
PRETRAINED_CONFIG = {
    "model_type": "llama",
    "vocab_size": 45,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
PRETRAINED_PARAMS = 37_804_032
# the decoder blocks' linears (what QLoRA quantises): 4 x (q, o 1024^2; k, v 1024 x 512;
# gate, up, down 2048 x 1024)
PRETRAINED_LINEAR_PARAMS = 4 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 2048 * 1024)


def save_pretrained_model(path: Path) -> None:
    """PRETRAINED_CONFIG's model in three safetensors shards with an index, from another seed
    than the runs' random init (so a run that ignored the weights would show)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    params = {k: v for k, v in PRETRAINED_CONFIG.items() if k != "model_type"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**params), dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="60MB")
