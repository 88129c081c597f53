"""Data pipeline: what carries loss, packing, attention isolation, order, bad rows, the cache."""

from __future__ import annotations

import json

import pytest
import torch

import trainer.data.documents as data_mod
from tests.conftest import REPO, TINY_LLAMA
from trainer.core.config import ConfigError, build_config
from trainer.data import build_data, build_tokenizer, tokenize_source
from trainer.loss import IGNORE_INDEX

TOKENIZER = REPO / "configs" / "demo" / "tokenizer"


def _cfg(tmp_path, rows, fmt="prompt_completion", **data):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))
    model = dict(TINY_LLAMA, vocab_size=45)
    return build_config(
        {
            "model": {"config": model, "tokenizer": str(TOKENIZER)},
            "data": {
                "path": str(path),
                "format": fmt,
                "seq_len": 32,
                "cache_dir": str(tmp_path / "cache"),
                **data,
            },
            "train": {"global_batch_size": 4, "micro_batch_size": 1},
        }
    )


ADDITIONS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(7)]


def _decode_targets(tok, batch, row):
    ids, labels = batch["input_ids"][row], batch["labels"][row]
    return tok.decode(ids[labels != IGNORE_INDEX])


def test_prompt_tokens_carry_no_loss(tmp_path):
    cfg = _cfg(tmp_path, [{"prompt": "12+34=", "completion": "46"}], pack=False)
    tok = build_tokenizer(cfg.model)
    batch = build_data(cfg, tok).train.micro_batches(0, 0, 1, 1, 4)[0]
    assert _decode_targets(tok, batch, 0) == "46<eos>"
    assert tok.decode(batch["input_ids"][0][batch["doc_ids"][0] >= 0]) == "<bos>12+34=46<eos>"


def test_chat_loss_only_on_assistant_turns(tmp_path):
    conv = {
        "messages": [
            {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "4+4="},
            {"role": "assistant", "content": "8"},
        ]
    }
    cfg = _cfg(tmp_path, [conv], fmt="chat", pack=False)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": 64})})
    tok = build_tokenizer(cfg.model)
    batch = build_data(cfg, tok).train.micro_batches(0, 0, 1, 1, 4)[0]
    assert _decode_targets(tok, batch, 0) == "assistant: 3<eos>\nassistant: 8<eos>\n"


def test_packing_resets_positions_and_never_predicts_across_documents(tmp_path):
    cfg = _cfg(tmp_path, ADDITIONS)
    tok = build_tokenizer(cfg.model)
    stream = build_data(cfg, tok).train
    w = stream.windows
    assert w.input_ids.shape[1] == 32
    assert (w.doc_ids[:-1].max(axis=1) >= 3).all()  # several documents per full window
    for r in range(len(w)):
        starts = [t for t in range(32) if w.doc_ids[r, t] >= 0 and w.position_ids[r, t] == 0]
        assert starts[0] == 0
        for t in starts:
            assert w.labels[r, t] == IGNORE_INDEX  # nothing predicts a document's first token
            assert w.input_ids[r, t] == tok.bos_token_id
        for t in range(1, 32):
            if w.doc_ids[r, t] == w.doc_ids[r, t - 1] >= 0:
                assert w.position_ids[r, t] == w.position_ids[r, t - 1] + 1


def test_packed_window_attends_only_within_each_document(tmp_path):
    """Logits of a packed window equal those of each document run alone (sdpa, no mask).

    The model is built as the engine builds it (use_cache off: transformers looks for packed
    position_ids only without a KV cache)."""
    from trainer.model.build import HFModelFactory

    cfg = _cfg(tmp_path, ADDITIONS)
    tok = build_tokenizer(cfg.model)
    w = build_data(cfg, tok).train.windows
    model = HFModelFactory(cfg.model, seed=0).build("cpu").eval()
    batch = w.batch([0])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        for d in range(int(batch["doc_ids"].max()) + 1):
            cols = (batch["doc_ids"][0] == d).nonzero().flatten()
            alone = model(input_ids=batch["input_ids"][:, cols]).logits[0]
            torch.testing.assert_close(packed[cols], alone, atol=1e-5, rtol=1e-4)


def test_order_is_a_function_of_seed_and_step_only(tmp_path):
    cfg = _cfg(tmp_path, ADDITIONS)
    tok = build_tokenizer(cfg.model)
    stream = build_data(cfg, tok).train

    def rows(step, world, micro):
        out = []
        for rank in range(world):
            for b in stream.micro_batches(step, rank, world, micro, 4):
                out += [tuple(r.tolist()) for r in b["input_ids"]]
        return out

    for step in (0, 5, 17):  # 17 * 4 windows is past one epoch: a reshuffled epoch
        ref = rows(step, 1, 4)
        assert rows(step, 2, 2) == ref and rows(step, 2, 1) == ref and rows(step, 4, 1) == ref
    assert rows(3, 1, 4) != rows(4, 1, 4)
    other = build_data(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 1})}), tok
    )
    assert [b["input_ids"].tolist() for b in other.train.micro_batches(0, 0, 1, 4, 4)] != [
        b["input_ids"].tolist() for b in stream.micro_batches(0, 0, 1, 4, 4)
    ]


def test_eval_split_is_held_out_and_every_rank_gets_as_many_batches(tmp_path):
    cfg = _cfg(tmp_path, ADDITIONS, eval_fraction=0.2)
    tok = build_tokenizer(cfg.model)
    bundle = build_data(cfg, tok)
    train_rows = {tuple(r) for r in bundle.train.windows.input_ids.tolist()}
    assert not train_rows & {tuple(r) for r in bundle.eval.windows.input_ids.tolist()}
    counts = [len(list(bundle.eval.batches(2, r, 3))) for r in range(3)]
    assert len(set(counts)) == 1 and counts[0] >= 1


def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path):
    rows = ADDITIONS[:5] + [{"prompt": "1+1="}] + ADDITIONS[5:]
    cfg = _cfg(tmp_path, rows)
    tok = build_tokenizer(cfg.model)
    with pytest.raises(ConfigError) as err:
        build_data(cfg, tok)
    msg = str(err.value)
    assert "rows.jsonl row 6" in msg and "'completion'" in msg and "\n" not in msg


def test_bad_rows_can_be_skipped_and_are_counted(tmp_path, caplog):
    rows = ADDITIONS[:5] + [{"prompt": "1+1=", "completion": 2}, {"prompt": "", "x": 1}]
    rows.append("not json")
    cfg = _cfg(tmp_path, rows, on_bad_row="skip", pack=False)
    tok = build_tokenizer(cfg.model)
    bundle = build_data(cfg, tok)
    assert len(bundle.train.windows) == 5
    assert "skipped 3 malformed rows" in caplog.text


def test_tokenised_data_is_cached(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, ADDITIONS)
    tok = build_tokenizer(cfg.model)
    first = tokenize_source(cfg.data.path, "data.path", cfg.data, tok, tmp_path / "cache")

    def no_reading(*args, **kwargs):
        raise AssertionError("the data was read again instead of the cache")

    monkeypatch.setattr(data_mod, "read_rows", no_reading)
    again = tokenize_source(cfg.data.path, "data.path", cfg.data, tok, tmp_path / "cache")
    assert (again.tokens == first.tokens).all() and (again.offsets == first.offsets).all()


def _save_at_once(cache, docs, barrier, failures):
    barrier.wait()
    try:
        data_mod._save_docs(cache, docs)
    except Exception as err:  # noqa: BLE001  (reported to the parent)
        failures.put(repr(err))


def test_jobs_saving_one_cache_at_once_all_succeed_and_leave_it_whole(tmp_path):
    """Jobs sharing data.cache_dir tokenise the same key at once (CI's hang test met `Directory
    not empty` this way): every save succeeds and one whole cache is left, nothing beside it. A
    cut-off save from before (no `done`) is replaced."""
    import multiprocessing as mp

    cfg = _cfg(tmp_path, ADDITIONS)
    docs = tokenize_source(
        cfg.data.path, "data.path", cfg.data, build_tokenizer(cfg.model), tmp_path / "c"
    )
    ctx = mp.get_context("fork")
    failures = ctx.Queue()
    for round_ in range(12):
        cache = tmp_path / "shared" / f"key{round_}"
        if round_ % 3 == 2:  # a save cut off before: no `done`
            cache.mkdir(parents=True)
            (cache / "tokens.npy").write_bytes(b"cut")
        barrier = ctx.Barrier(6)
        procs = [
            ctx.Process(target=_save_at_once, args=(cache, docs, barrier, failures))
            for _ in range(6)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert failures.empty(), failures.get()
        assert data_mod._load_docs(cache).tokens.tolist() == docs.tokens.tolist()
        assert {x.name for x in cache.parent.iterdir()} == {f"key{r}" for r in range(round_ + 1)}


BOOK = "Chapter one.\n\nIt was a dark night.\nRain fell.\n\n\n   \nChapter two.\n"


@pytest.mark.parametrize(
    ("unit", "documents"),
    [
        ("document", [BOOK]),
        ("paragraph", ["Chapter one.", "It was a dark night.\nRain fell.", "Chapter two."]),
        ("line", ["Chapter one.", "It was a dark night.", "Rain fell.", "Chapter two."]),
    ],
)
def test_a_text_file_is_read_by_data_text_unit_and_blank_lines_are_no_error(
    tmp_path, unit, documents
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.txt").write_text(BOOK)
    (corpus / "empty.txt").write_text("\n\n")  # a blank file holds no document
    cfg = _cfg(tmp_path, [], fmt="text", text_unit=unit)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": str(corpus)})})
    tok = build_tokenizer(cfg.model)
    docs = tokenize_source(cfg.data.path, "data.path", cfg.data, tok, tmp_path / "cache")
    got = [docs.doc(i)[0].tolist() for i in range(docs.num_docs)]
    assert got == [tok(d)["input_ids"] + [tok.eos_token_id] for d in documents]
