"""Data: read with HF `datasets`, tokenise once (cached), pack into windows, pick batches by step.

Formats (`data.format`):
- `text`: loss on every token. Documents are concatenated and split across windows.
- `prompt_completion`: loss on the completion only. Documents are packed whole (a document longer
  than `data.seq_len` is truncated, and counted in the log).
- `chat`: a list of {role, content} messages rendered with the tokenizer's chat template; loss on
  the assistant turns only (found by rendering growing prefixes of the conversation). Packed whole.

Packing: every window holds `data.seq_len` tokens; `position_ids` restart at 0 at each document
and the first token of a document is never a target, so nothing is predicted across documents.
With `attention_mask=None`, no KV cache (the engine builds models with `use_cache=False`) and packed
`position_ids`, transformers (sdpa/eager/flex on models that use its masking utilities, e.g.
Llama, Qwen2, Mistral, Gemma) builds a block-diagonal causal mask from the position resets, so
tokens attend only within their document (tests check this). A model
that ignores `position_ids` for masking would attend across documents of one window; set
`data.pack: false` for such models (one document per window, padded).

Order: the global batch of optimizer step `s` is a fixed set of windows chosen by `train.seed` and
`s` alone (epochs reshuffle with the seed and the epoch), independent of world size and
micro-batch. The step is therefore the whole data position: resuming, changing the strategy or
backing off the micro-batch sees the same data.
"""

from trainer.data.batches import DataBundle, build_data, split_eval, train_data_fingerprint
from trainer.data.documents import build_tokenizer, tokenize_all, tokenize_source

__all__ = [
    "DataBundle",
    "build_data",
    "build_tokenizer",
    "split_eval",
    "tokenize_all",
    "tokenize_source",
    "train_data_fingerprint",
]
