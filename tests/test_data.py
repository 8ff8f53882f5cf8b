"""Training data: the shipped tokenizer and corpus, packing, resume, and every data error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain.errors import DataError
from lazytrain.train import build_tokenizer
from lazytrain.train.data import (
    CORPUS_PATH,
    TOKENIZER_PATH,
    PackedBatches,
    builtin_batches,
    builtin_tokenizer,
    check_vocab,
    load_tokenizer,
)
from lazytrain.train.packing import UNPACKED

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ids_jsonl(path: Path, *docs: list[int]) -> Path:
    return write_jsonl(path, [{"input_ids": d} for d in docs])


def take(batches: PackedBatches, n: int) -> list[torch.Tensor]:
    return [next(batches)["input_ids"] for _ in range(n)]


# --------------------------------------------------------------------------- assets


def test_builtin_tokenizer_has_512_ids_and_special_tokens(tok):
    assert len(tok) == 512
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 1
    text = "Rivers carry mud to the sea. Ünïcödé ☃ and tabs\tstill encode."
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < 512
    assert tok.decode(ids) == text


def test_build_tokenizer_reproduces_the_shipped_file(tmp_path):
    out = build_tokenizer.build(CORPUS_PATH, tmp_path / "tokenizer.json")
    assert out.read_bytes() == TOKENIZER_PATH.read_bytes()


def test_corpus_is_a_modest_natural_text():
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert 50_000 <= len(text.encode()) <= 150_000
    words = text.split()
    assert len(words) > 8_000 and len(set(words)) > 1_500


# --------------------------------------------------------------------------- packing


def test_builtin_batches_shapes(tok):
    """Attention across documents (UNPACKED): labels are the inputs, positions count along each row."""
    batches = builtin_batches(4, 64, shuffle=False, layout=UNPACKED)
    assert batches.tokens_per_batch == 256
    assert batches.rows_per_epoch == batches.num_tokens // 64
    batch = next(batches)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.shape == (4, 64) and t.dtype == torch.long for t in batch.values())
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert torch.equal(batch["position_ids"], torch.arange(64).expand(4, 64))
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    # Unshuffled, epoch 0 is the stream in order: the first row starts the corpus, whose
    # paragraphs (separated by blank lines) are documents joined by eos.
    documents = CORPUS_PATH.read_text().replace("\n\n", "<|endoftext|>")
    assert documents.startswith(tok.decode(batch["input_ids"][0]))


def test_documents_are_joined_by_eos_and_the_tail_is_dropped(tmp_path, tok):
    data = ids_jsonl(tmp_path / "d.jsonl", [5, 6, 7], [8, 9], [10, EOS])
    batches = PackedBatches(data, tok, batch_size=1, seq_len=3, shuffle=False)
    # stream 5 6 7 eos 8 9 eos 10 eos: a record already ending in eos gets no second one
    assert batches.num_tokens == 9 and batches.rows_per_epoch == 3
    assert [b.tolist() for b in take(batches, 3)] == [[[5, 6, 7]], [[EOS, 8, 9]], [[EOS, 10, EOS]]]


def test_text_files_jsonl_text_and_directories_tokenise_like_the_tokenizer(tmp_path, tok):
    (tmp_path / "a.txt").write_text("The moon is bright.")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "Bees make honey."}, {"text": ""}])
    (tmp_path / "notes.md").write_text("ignored: directories only contribute .txt and .jsonl")
    expected = []
    for text in ("The moon is bright.", "Bees make honey."):
        expected += tok.encode(text, add_special_tokens=False) + [EOS]
    seq_len = len(expected)
    batches = PackedBatches(tmp_path, tok, batch_size=1, seq_len=seq_len)
    assert next(batches)["input_ids"][0].tolist() == expected


def test_every_epoch_is_a_seeded_permutation_of_the_rows(tmp_path, tok):
    """The first epoch too is shuffled (not file order), each epoch differently, deterministically
    per seed; `shuffle=False` reads every epoch in file order."""
    data = ids_jsonl(tmp_path / "d.jsonl", *[[i + 2] for i in range(12)])  # 24 tokens
    first = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=7)
    again = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=7)
    other = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=8)
    in_order = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=7, shuffle=False)
    assert first.rows_per_epoch == 12
    a, b, c, d = take(first, 18), take(again, 18), take(other, 18), take(in_order, 18)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    stream = [[i + 2, EOS] for i in range(12)]  # file order
    epochs = [torch.cat(a[i : i + 6]).tolist() for i in (0, 6, 12)]
    for epoch in epochs:
        assert sorted(epoch) == stream and epoch != stream
    assert epochs[0] != epochs[1] != epochs[2]
    assert torch.cat(c[:6]).tolist() != epochs[0] and sorted(torch.cat(c[:6]).tolist()) == stream
    assert [torch.cat(d[i : i + 6]).tolist() for i in (0, 6, 12)] == [stream] * 3
    assert in_order.state_dict()["shuffle_from"] is None and first.state_dict()["shuffle_from"] == 0


def test_a_batch_continues_into_the_next_epoch(tmp_path, tok):
    data = ids_jsonl(tmp_path / "d.jsonl", *[[i + 2] for i in range(5)])  # 5 rows of 2
    batches = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=3)
    rows = torch.cat(take(batches, 5)).tolist()  # 10 rows: epoch 0 then epoch 1
    stream = [[i + 2, EOS] for i in range(5)]
    assert sorted(rows[:5]) == stream and sorted(rows[5:]) == stream
    assert batches.epoch == 2 and batches.state_dict()["row"] == 0


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_text(CORPUS_PATH.read_text()[:1500])
    return path


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_size=st.integers(1, 5),
    seq_len=st.integers(4, 40),
    seed=st.integers(0, 2**40),
    consumed=st.integers(0, 60),
    resume_batch_size=st.none() | st.integers(1, 5),
    shuffle=st.booleans(),
)
def test_resume_at_any_position_yields_the_uninterrupted_batches(
    tok, small_text, batch_size, seq_len, seed, consumed, resume_batch_size, shuffle
):
    straight = PackedBatches(small_text, tok, batch_size, seq_len, seed=seed, shuffle=shuffle)
    take(straight, consumed)
    state = json.loads(json.dumps(straight.state_dict()))  # as stored in checkpoint meta
    # A fresh process may even be built with another seed and order: the position carries them.
    resumed = PackedBatches(
        small_text, tok, resume_batch_size or batch_size, seq_len, seed=seed + 1, shuffle=not shuffle
    )
    resumed.load_state_dict(state)
    if resume_batch_size is None:
        for want, got in zip(take(straight, 8), take(resumed, 8)):
            assert torch.equal(want, got)
    else:  # the position is in rows, so the same rows follow in any batch size
        n = 8 * batch_size * resume_batch_size
        want = torch.cat(take(straight, n // batch_size))
        got = torch.cat(take(resumed, n // resume_batch_size))
        assert torch.equal(want, got)


def test_a_position_saved_before_the_first_epoch_was_shuffled_resumes_as_it_began(tmp_path, tok):
    """A data position without `shuffle_from` (saved when epoch 0 was read in file order and later
    epochs permuted) continues that order: file order to the end of epoch 0, then the epoch-1
    permutation the run would have drawn."""
    data = ids_jsonl(tmp_path / "d.jsonl", *[[i + 2] for i in range(12)])
    shuffled = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=5)
    take(shuffled, 6)
    epoch1 = torch.cat(take(shuffled, 6)).tolist()  # the epoch-1 permutation of seed 5
    old = shuffled.state_dict()
    old.update(epoch=0, row=4)
    del old["shuffle_from"]
    resumed = PackedBatches(data, tok, batch_size=2, seq_len=2, seed=0)
    resumed.load_state_dict(old)
    assert torch.cat(take(resumed, 10)).tolist() == [[i + 2, EOS] for i in range(4, 12)] + epoch1
    with pytest.raises(DataError, match="is not a PackedBatches state"):
        resumed.load_state_dict({**old, "shuffle_from": 2})


def test_resume_over_different_data_is_refused(tmp_path, tok, small_text):
    batches = PackedBatches(small_text, tok, 2, 8)
    take(batches, 3)
    state = batches.state_dict()
    other = tmp_path / "other.txt"
    other.write_text(small_text.read_text().replace("a", "o"))
    changed = PackedBatches(other, tok, 2, 8)
    with pytest.raises(DataError, match="saved data position was taken over different data"):
        changed.load_state_dict(state)
    with pytest.raises(DataError, match="is not a PackedBatches state"):
        batches.load_state_dict({"epoch": 1})


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path, tok):
    with pytest.raises(DataError, match=r"data path .*nope\.txt does not exist"):
        PackedBatches(tmp_path / "nope.txt", tok, 1, 4)


def test_unknown_suffix(tmp_path, tok):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"table\.csv has unknown suffix '\.csv'; use \.txt"):
        PackedBatches(path, tok, 1, 4)


def test_empty_dataset(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    ids_jsonl(tmp_path / "none.jsonl", [])
    with pytest.raises(DataError, match=r"the training data has no tokens \(all documents are empty\)"):
        PackedBatches([tmp_path / "empty.txt", tmp_path / "blank.jsonl", tmp_path / "none.jsonl"], tok, 1, 4)


def test_examples_with_nothing_to_learn_say_why(tmp_path):
    """Data of examples that were all skipped is not called empty: the message says which had
    nothing to learn (no assistant turn, no learnt label, truncated before the first learnt token),
    how many were skipped, and the fix."""
    tok = builtin_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi there"}]}] * 3)
    with pytest.raises(DataError) as info:
        PackedBatches(chats, tok, 1, 16)
    message = str(info.value)
    assert "no example in" in message and "chat.jsonl has anything to learn" in message
    assert "all 3 examples skipped (3 conversations have no assistant turn" in message
    assert "add the assistant's reply to each conversation" in message and "all documents are empty" not in message
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a long prompt " * 20, "completion": " yes"}])
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}])
    with pytest.raises(DataError, match=r"all 2 examples skipped \(1 example has no learnt token .*; 1 example was "
                                        r"truncated to seq_len 16 before the first learnt token\); give each "
                                        r"example a completion or labels to learn, or pass a larger seq_len"):
        PackedBatches([long, ids], tok, 1, 16)


def test_fewer_tokens_than_one_batch(tmp_path, tok):
    data = ids_jsonl(tmp_path / "d.jsonl", [5, 6, 7], [8, 9])  # 7 tokens with the eos
    with pytest.raises(DataError, match=r"has 7 tokens but one batch of 4 x 8 needs 32"):
        PackedBatches(data, tok, batch_size=4, seq_len=8)


def test_invalid_json_line_names_file_and_line(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2 is not valid JSON"):
        PackedBatches(path, tok, 1, 4)


def test_record_without_text_or_input_ids(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no"}])
    with pytest.raises(DataError, match=r'd\.jsonl:2 has none of the fields "text", "input_ids"'):
        PackedBatches(path, tok, 1, 4)
    path = write_jsonl(tmp_path / "e.jsonl", [["not", "an", "object"]])
    with pytest.raises(DataError, match=r"e\.jsonl:1 is a JSON array, not an object"):
        PackedBatches(path, tok, 1, 4)


def test_pretokenised_record_longer_than_seq_len(tmp_path, tok):
    data = ids_jsonl(tmp_path / "d.jsonl", [5] * 4, [6] * 9)
    with pytest.raises(
        DataError,
        match=r"d\.jsonl:2: sequence of 9 tokens is longer than the compiled shape's seq_len 8",
    ):
        PackedBatches(data, tok, 1, 8)


def test_pretokenised_ids_outside_the_vocab(tmp_path, tok):
    data = ids_jsonl(tmp_path / "d.jsonl", [5, 600])
    outside = r"d\.jsonl:1: token id 600 is outside the vocab \(valid ids are 0\.\.511\)"
    with pytest.raises(DataError, match=outside):
        PackedBatches(data, tok, 1, 2)
    data = ids_jsonl(tmp_path / "neg.jsonl", [5, -1])
    with pytest.raises(DataError, match="token id -1 is outside the vocab"):
        PackedBatches(data, tok, 1, 2)
    # With the model's vocab_size given, that is the bound (it may exceed the tokenizer's).
    data = ids_jsonl(tmp_path / "model.jsonl", [5, 600])
    assert PackedBatches(data, tok, 1, 2, vocab_size=1024).num_tokens == 3
    with pytest.raises(DataError, match=r"token id 600 is outside the vocab .*0\.\.599"):
        PackedBatches(data, tok, 1, 2, vocab_size=600)
    write_jsonl(tmp_path / "f.jsonl", [{"input_ids": [1, 2.5]}])
    with pytest.raises(DataError, match=r'f\.jsonl:1: "input_ids" must be a list of integers'):
        PackedBatches(tmp_path / "f.jsonl", tok, 1, 2)


def test_check_vocab(tok):
    check_vocab(tok, 512)
    check_vocab(tok, 151_936)
    message = (
        r"the tokenizer produces token ids up to 511 \(512 ids\) but the model's vocab_size is "
        r"256; use the model's own tokenizer or a model config with vocab_size >= 512"
    )
    with pytest.raises(DataError, match=message):
        check_vocab(tok, 256)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, tok):
    (tmp_path / "a.txt").write_text("Some text.")
    with pytest.raises(DataError, match="vocab_size is 300"):
        PackedBatches(tmp_path / "a.txt", tok, 1, 2, vocab_size=300)


def test_invalid_batch_shape(tmp_path, tok):
    (tmp_path / "a.txt").write_text("Some text.")
    with pytest.raises(DataError, match="batch_size=0, seq_len=4"):
        PackedBatches(tmp_path / "a.txt", tok, 0, 4)


# --------------------------------------------------------------------------- load_tokenizer


def test_load_tokenizer_from_json_file_and_directory(tmp_path, tok):
    text = "Soil forms very slowly."
    want = tok.encode(text, add_special_tokens=False)
    from_file = load_tokenizer(TOKENIZER_PATH)
    assert from_file.encode(text, add_special_tokens=False) == want
    assert from_file.eos_token_id == 0  # found by name in a bare tokenizer.json
    tok.save_pretrained(tmp_path / "tok")
    from_dir = load_tokenizer(tmp_path / "tok")
    assert from_dir.encode(text, add_special_tokens=False) == want
    assert from_dir.eos_token_id == 0 and from_dir.pad_token_id == 1


def test_load_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer .*missing does not exist"):
        load_tokenizer(tmp_path / "missing")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(DataError, match=r"could not load a tokenizer from .*tokenizer\.json"):
        load_tokenizer(bad)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match=r"could not load a tokenizer from .*emptydir"):
        load_tokenizer(tmp_path / "emptydir")


def test_tokenizer_without_eos_is_refused(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH))
    (tmp_path / "a.txt").write_text("Some text.")
    with pytest.raises(DataError, match="the tokenizer has no end-of-text token"):
        PackedBatches(tmp_path / "a.txt", bare, 1, 2)
