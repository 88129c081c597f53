"""Build the demo's tokenizer and data: 2-digit addition as prompt/completion pairs, and
preference pairs for DPO/ORPO/SimPO (the right sum chosen, a near miss rejected).

The task is one a person can check at a glance ("37+45=" -> "82") and a small randomly
initialised model learns it in a couple of CPU minutes, so the demo shows the loss falling and
the held-out exact-match accuracy rising. The eval pairs never occur in the training file.

    python configs/demo/make_demo_data.py      # rewrites tokenizer/, train.jsonl, eval.jsonl,
                                               # pairs_train.jsonl, pairs_eval.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHARS = list("0123456789+=")
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
)


def build_tokenizer(out: Path) -> None:
    """A character-level tokenizer saved as a transformers PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {
        tok: i for i, tok in enumerate(SPECIAL + CHARS + list(" abcdefghijklmnopqrstuvwxyz:\n"))
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def main() -> None:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:200], pairs[200:]

    def rows(ps):
        return [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in ps]

    for name, ps in (("train.jsonl", train_pairs), ("eval.jsonl", eval_pairs)):
        with (HERE / name).open("w") as f:
            for row in rows(ps):
                f.write(json.dumps(row) + "\n")
    write_preference_pairs(train_pairs[:2000], eval_pairs[:100], rng)
    build_tokenizer(HERE / "tokenizer")
    print(f"{len(train_pairs)} train and {len(eval_pairs)} eval rows, tokenizer in {HERE}")


def write_preference_pairs(train, held_out, rng: random.Random) -> None:
    """{prompt, chosen, rejected}: the right sum, and a wrong one off by 1, 2 or 10 either way
    (the mistakes a half-taught model makes: a carry lost, a last digit off)."""
    for name, ps in (("pairs_train.jsonl", train), ("pairs_eval.jsonl", held_out)):
        with (HERE / name).open("w") as f:
            for a, b in ps:
                wrong = a + b + rng.choice([-10, -2, -1, 1, 2, 10])
                wrong = wrong if wrong >= 0 else a + b + 1
                row = {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
