"""`--data` formats beyond plain packing: documents in .txt, Parquet and saved datasets, prompt
and chat masking (checked against eager cross-entropy through a compiled step), pre-tokenised ids
against the model's vocabulary, and pathological JSON reported as one line naming file and line."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lazytrain.errors import DataError
from lazytrain.train import tokens
from lazytrain.train import data
from lazytrain.train.data import TOKENIZER_PATH, builtin_tokenizer

EOS, PAD, IGNORE = 0, 1, -100
# These tests read the rows in file order.
PackedBatches = functools.partial(data.PackedBatches, shuffle=False)
# Newlines as expressions: transformers renders templates with trim_blocks.
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue, on a clear day."},
    {"role": "user", "content": "And at night?"},
    {"role": "assistant", "content": "Dark, with stars."},
]


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    """The shipped 512-id tokenizer with a chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_PATH), eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows(batches: PackedBatches) -> list[tuple[list[int], list[int]]]:
    """Every row of epoch 0 as (input_ids, labels)."""
    out = []
    for _ in range(batches.rows_per_epoch // batches.batch_size):
        batch = next(batches)
        out += list(zip(batch["input_ids"].tolist(), batch["labels"].tolist()))
    return out


def expected_row(tokenizer, parts: list[tuple[str | int, bool]], seq_len: int):
    """(input_ids, labels) of one padded example from (text or token id, supervised) parts."""
    ids, labels = [], []
    for part, learnt in parts:
        part_ids = [part] if isinstance(part, int) else enc(tokenizer, part)
        ids += part_ids
        labels += part_ids if learnt else [IGNORE] * len(part_ids)
    pad = seq_len - len(ids)
    return ids + [PAD] * pad, labels + [IGNORE] * pad


# --------------------------------------------------------------------------- .txt documents


def test_blank_lines_separate_txt_documents(tmp_path, tok):
    text = "First line\nsame document\n\nSecond one\n\n \n\t\nThird, after blank lines\n\n"
    (tmp_path / "a.txt").write_text(text)
    docs = ["First line\nsame document", "Second one", "Third, after blank lines"]
    want = [i for d in docs for i in enc(tok, d) + [EOS]]
    batches = PackedBatches(tmp_path / "a.txt", tok, 1, len(want))
    assert batches.stats.documents == 3
    assert next(batches)["input_ids"][0].tolist() == want


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_long_line_is_tokenised_in_bounded_pieces(tmp_path, tok, monkeypatch, suffix):
    """No text longer than the piece size reaches the tokenizer, yet the tokens are those of the
    whole line: pieces are cut before a space."""
    words = "the quick brown fox jumps over a lazy dog while rivers carry mud to the sea".split()
    line = " ".join(words[i % len(words)] for i in range(3000))
    path = tmp_path / f"long{suffix}"
    path.write_text(line if suffix == ".txt" else json.dumps({"text": line}) + "\n")
    seen = []
    encode = tokens._encode
    monkeypatch.setattr(tokens, "PIECE_CHARS", 100)
    monkeypatch.setattr(tokens, "_encode", lambda t, texts: seen.extend(texts) or encode(t, texts))
    want = enc(tok, line) + [EOS]
    batches = PackedBatches(path, tok, 1, 16)
    assert max(len(t) for t in seen) <= 100 and len(seen) > 100
    assert batches.num_tokens == len(want)
    got = torch.cat([next(batches)["input_ids"][0] for _ in range(batches.rows_per_epoch)])
    assert got.tolist() == want[: len(got)]


# --------------------------------------------------------------------------- Parquet, saved datasets


def test_parquet_and_saved_dataset_inputs(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["Rivers carry mud.", "Bees make honey.", "The moon is bright."]
    pq.write_table(pa.table({"text": texts[:2], "id": [1, 2]}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"text": texts[2:]}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:1]})}).save_to_disk(
        str(tmp_path / "splits")
    )
    want = [i for d in texts + texts[:1] for i in enc(tok, d) + [EOS]]
    paths = [tmp_path / "a.parquet", tmp_path / "saved", tmp_path / "splits"]
    batches = PackedBatches(paths, tok, 1, len(want))
    assert next(batches)["input_ids"][0].tolist() == want
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(tmp_path / "nosplit")
    )
    with pytest.raises(DataError, match=r"nosplit has splits \['test'\] but no 'train'"):
        PackedBatches(tmp_path / "nosplit", tok, 1, 4)


def test_json_arrays(tmp_path, tok):
    texts = ["Rivers carry mud.", "Bees make honey."]
    (tmp_path / "objects.json").write_text(json.dumps([{"text": t} for t in texts], indent=1))
    (tmp_path / "strings.json").write_text(json.dumps(texts))
    want = [i for d in texts + texts for i in enc(tok, d) + [EOS]]
    batches = PackedBatches([tmp_path / "objects.json", tmp_path / "strings.json"], tok, 1, len(want))
    assert next(batches)["input_ids"][0].tolist() == want
    deep = tmp_path / "deep.json"
    deep.write_text('[{"text": "ok"},\n {"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}]")
    with pytest.raises(DataError, match=r"deep\.json:2 could not be read as JSON .*depth limit"):
        PackedBatches(deep, tok, 1, 2)


# --------------------------------------------------------------------------- masking


def test_instruction_records_mask_the_prompt(tmp_path, tok):
    records = [
        {"prompt": "Question: what do bees make?\nAnswer:", "completion": " Honey."},
        {"prompt": "Name a colour:", "completion": " Blue"},
    ]
    batches = PackedBatches(write_jsonl(tmp_path / "i.jsonl", records), tok, 1, 32)
    want = [
        expected_row(tok, [(r["prompt"], False), (r["completion"], True), (EOS, True)], 32)
        for r in records
    ]
    assert rows(batches) == want
    assert batches.stats.examples == 2


def test_chat_records_learn_only_assistant_tokens(tmp_path, chat_tok):
    def turn(m):  # how the template renders one message, and whether it is learnt
        head = (f"<|{m['role']}|>\n", False)
        if m["role"] == "assistant":
            return [head, (m["content"], True), (EOS, True), ("\n", True)]
        return [head, (m["content"] + "\n", False)]

    parts = [p for m in CHAT for p in turn(m)]
    full = chat_tok.apply_chat_template(CHAT, tokenize=False)
    ids, _ = expected_row(chat_tok, parts, 0)
    assert enc(chat_tok, full) == ids  # the parts tokenise as the whole does
    batches = PackedBatches(
        write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}]),
        chat_tok, 1, 128,
    )
    second = [p for m in CHAT[1:3] for p in turn(m)]
    assert rows(batches) == [expected_row(chat_tok, parts, 128), expected_row(chat_tok, second, 128)]


def test_chat_records_need_a_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: chat records need a tokenizer with a chat "
                                        r"template.*records \(their labels are -100 on the prompt"):
        PackedBatches(path, tok, 1, 96)


def test_long_examples_are_truncated_and_empty_ones_skipped(tmp_path, tok):
    records = [
        {"prompt": "short", "completion": " one two three four five six seven eight nine ten"},
        {"prompt": "a prompt far longer than the row " * 4, "completion": " lost"},
        {"prompt": "ok", "completion": " fine"},
    ]
    batches = PackedBatches(write_jsonl(tmp_path / "i.jsonl", records), tok, 1, 12)
    stats = batches.stats
    assert (stats.examples, stats.truncated, stats.truncated_away, stats.skipped) == (2, 2, 1, 1)
    assert stats.describe(12) == ("data: 2 of 3 examples truncated to seq_len 12, 1 of them skipped: nothing left "
                                  "to learn after truncation")
    first, second = rows(batches)
    ids, labels = expected_row(tok, [("short", False), (records[0]["completion"], True)], 0)
    assert len(ids) > 12 and first == (ids[:12], labels[:12])
    assert second == expected_row(tok, [("ok", False), (" fine", True), (EOS, True)], 12)


def test_pretokenised_labels_become_a_masked_example(tmp_path, tok):
    path = write_jsonl(tmp_path / "l.jsonl", [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}])
    assert rows(PackedBatches(path, tok, 1, 6)) == [([5, 6, 7, 8, PAD, PAD], [-100, -100, 7, 8, -100, -100])]
    path = write_jsonl(tmp_path / "m.jsonl", [{"input_ids": [5, 6], "labels": [5, 9]}])
    with pytest.raises(DataError, match=r'm\.jsonl:1: "labels" must .* equal to that input id or -100'):
        PackedBatches(path, tok, 1, 6)


def test_masked_first_step_loss_equals_eager_cross_entropy(tmp_path, chat_tok):
    """The compiled step's loss on masked, padded rows (its loss stage chunked by rows) is the
    eager model's and plain cross-entropy over the learnt tokens, shifted by one."""
    from lazytrain.pipeline import compile_model
    from checks import bind_source
    from models import hf_config, model_pair
    from transformers import Qwen2ForCausalLM

    records = [
        {"messages": CHAT},
        {"prompt": "Question: what do bees make?\nAnswer:", "completion": " Honey."},
        {"text": "Rivers carry mud to the sea. " * 3},
        {"prompt": "Name a colour:", "completion": " Blue"},
    ]
    files = [write_jsonl(tmp_path / f"d{i}.jsonl", [r]) for i, r in enumerate(records)]  # one format a file
    batches = PackedBatches(files, chat_tok, 4, 64)
    batch = next(batches)
    assert (batch["labels"] == IGNORE).any() and (batch["labels"] != IGNORE).any()
    meta, real = model_pair(lambda: Qwen2ForCausalLM(hf_config("qwen2", layers=2, vocab=512)))
    compiled = compile_model(meta, batch, 1 << 30, "cpu", source="test", time_limit=20,
                             loss_chunk_bytes=1)
    assert compiled.stages.stages[-1].chunks > 1  # the masked loss summed over chunks
    with torch.no_grad():
        eager = real(**batch).loss
        logits = real(input_ids=batch["input_ids"]).logits
    reference = F.cross_entropy(logits[:, :-1].reshape(-1, 512), batch["labels"][:, 1:].reshape(-1),
                                ignore_index=IGNORE)
    trainer, ours = bind_source(compiled.source_text, real, lr=1e-3)
    loss = trainer.forward_backward(batch)  # gradients too: every parameter's equals eager's
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, reference, atol=1e-5, rtol=1e-5)
    real.zero_grad()
    real(**batch).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), real.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_resume_over_masked_examples(tmp_path, tok):
    records = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "i.jsonl", records)
    straight = PackedBatches(path, tok, 3, 12, seed=5)
    for _ in range(4):
        next(straight)
    resumed = PackedBatches(path, tok, 3, 12, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for _ in range(6):
        want, got = next(straight), next(resumed)
        assert torch.equal(want["input_ids"], got["input_ids"])
        assert torch.equal(want["labels"], got["labels"])
    unmasked = write_jsonl(tmp_path / "u.jsonl", [{"input_ids": r} for r in next(resumed)["input_ids"].tolist()])
    assert PackedBatches(unmasked, tok, 1, 12).data_digest != straight.data_digest


# --------------------------------------------------------------------------- vocabulary


def test_pretokenised_ids_are_checked_against_the_models_vocab(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "ids.jsonl"
    path.write_text('{"input_ids": [5, 700, 999]}\n\n{"input_ids": [3, 1000]}\n')
    with pytest.raises(DataError, match=r"ids\.jsonl:3: token id 1000 is outside the vocab "
                                        r"\(valid ids are 0\.\.999\)"):
        PackedBatches(path, tok, 1, 4, vocab_size=1000)
    pq.write_table(pa.table({"input_ids": [[5, 700, 999], [6, 7]]}), tmp_path / "ids.parquet")
    batches = PackedBatches(tmp_path / "ids.parquet", tok, 1, 7, vocab_size=1000)
    assert next(batches)["input_ids"][0].tolist() == [5, 700, 999, EOS, 6, 7, EOS]
    with pytest.raises(DataError, match=r"ids\.parquet record 1: token id 700 is outside the vocab"):
        PackedBatches(tmp_path / "ids.parquet", tok, 1, 7, vocab_size=600)


# --------------------------------------------------------------------------- pathological JSON


@pytest.mark.parametrize("line, message", [
    (b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "is nested 100001 levels deep, more than the 100"),
    (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "is nested 100001 levels deep"),
    (b'{"input_ids": [5, ' + b"9" * 5000 + b"]}", '"input_ids" must be a list of integers, but holds inf'),
    (b'{"text": "a\\ud800b"}', "holds a lone UTF-16 surrogate escape .* fix or drop the string"),
    (b'{"text": "unterminated}', r"is not valid JSON \(Unterminated string"),
    (b'{"text": "bad byte \xff"}', "is not valid UTF-8"),
])
def test_pathological_json_is_one_line_naming_file_and_line(tmp_path, tok, line, message):
    path = tmp_path / "p.jsonl"
    fine = b'{"input_ids": [5]}' if line.startswith(b'{"input_ids"') else b'{"text": "fine"}'  # one format a file
    path.write_bytes(fine + b"\n\n" + line + b"\n" + fine + b"\n")
    with pytest.raises(DataError, match=r"p\.jsonl:3:? " + message) as info:
        PackedBatches(path, tok, 1, 2)
    assert "\n" not in str(info.value)


def test_records_that_change_format_part_way_through_a_file(tmp_path, tok):
    """Past the first MiB the reader itself fails on the new fields; the error is still located."""
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [{"text": "hello world " * 50}] * 3000 + [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r'mixed\.jsonl:3001 is a \{"prompt", "completion"\} record, but .*'
                                        r"mixed\.jsonl:1, the file's first, is a \{\"text\"\} record; "
                                        r"keep one record format per file"):
        PackedBatches(path, tok, 1, 8)


def test_large_integers_and_surrogate_pairs_where_harmless_are_accepted(tmp_path, tok):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"text": "emoji \\ud83d\\ude00 pair", "n": ' + "9" * 5000 + "}\n")
    want = enc(tok, "emoji \U0001F600 pair") + [EOS]
    assert next(PackedBatches(path, tok, 1, len(want)))["input_ids"][0].tolist() == want


def test_train_on_chat_records_from_the_command_line(tmp_path, capsys, chat_tok):
    """`lazytrain train --data chat.jsonl --tokenizer DIR` trains the default model on padded,
    masked rows: the compiled step accepts the batches and the loss is finite."""
    from lazytrain.cli import main

    chat_tok.save_pretrained(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}] * 7 + [{"messages": CHAT}])
    code = main(["train", "--steps", "2", "--data", str(data), "--tokenizer", str(tmp_path / "tok"),
                 "--no-progress", "--log", str(tmp_path / "log.jsonl")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "data: 1 of 8 examples truncated to seq_len 64\n" in out
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
