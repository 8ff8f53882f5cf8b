"""Packing examples into rows (NOTE: [Packing] in lazytrain/train/packing.py), on the data alone:
best fit decreasing fills rows with whole examples, deterministically; every sequence's first
label is -100 and its positions restart; a resumed position yields the batches an uninterrupted
run would; `--packing off --cross-document-attention` writes the rows earlier versions wrote; and
chat-like data at 1024 tokens packs to under 5% padding."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lazytrain.errors import DataError
from lazytrain.train.data import PackedBatches, builtin_tokenizer
from lazytrain.train.evaluation import EvalSet
from lazytrain.train.packing import UNPACKED, Layout, best_fit_decreasing

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def write_examples(path, lengths, seed=0, vocab=500):
    """{"input_ids", "labels"} records of these lengths: a prompt (a third, labels -100) then a
    completion; every id distinct within the file, so an example is found again by its ids."""
    rng = random.Random(seed)
    records = []
    for n in lengths:
        ids = [rng.randrange(2, vocab) for _ in range(n)]
        records.append({"input_ids": ids, "labels": [IGNORE if j < n // 3 else t for j, t in enumerate(ids)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def sequences(batch: dict) -> list[tuple[list[int], list[int], bool]]:
    """Each run of a batch's rows between position restarts: (ids, labels, is padding at a row's end)."""
    out = []
    for ids, labels, pos in zip(*(batch[k].tolist() for k in ("input_ids", "labels", "position_ids"))):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))
            out.append((ids[a:b], labels[a:b], b == len(pos) and all(x == IGNORE for x in labels[a:b])))
    return out


def all_rows(batches: PackedBatches) -> dict:
    """Every row of an unshuffled epoch, as one batch."""
    parts = [next(batches) for _ in range(batches.rows_per_epoch // batches.batch_size)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_best_fit_decreasing():
    assert best_fit_decreasing([3, 5, 2, 4], 8) == [[1, 0], [3, 2]]
    lengths = [random.Random(1).randint(1, 100) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 128) + 2  # within two rows of perfect
    assert best_fit_decreasing(lengths, 128) == bins


def test_examples_are_packed_whole_and_kept_apart(tmp_path, tok):
    """Every example comes back whole, in one row, its positions from 0, its first label -100 and
    the rest its own; padding only ends a row; the same data packs the same rows twice."""
    lengths = [random.Random(2).randint(2, 20) for _ in range(60)]
    records = write_examples(tmp_path / "ex.jsonl", lengths)
    batches = PackedBatches(tmp_path / "ex.jsonl", tok, 2, 32, shuffle=False)
    rows = all_rows(batches)
    assert batches.separated and batches.packing.examples == 60
    assert batches.rows_per_epoch < 60 / 2  # several examples to a row
    found = [s for s in sequences(rows) if not s[2]]
    assert len(found) == 60
    by_ids = {tuple(r["input_ids"]): r for r in records}
    for ids, labels, _ in found:
        record = by_ids.pop(tuple(ids))
        assert labels == [IGNORE] + record["labels"][1:]
    assert not by_ids
    padding = [ids for ids, _, pad in sequences(rows) if pad]
    assert padding and all(set(ids) == {tok.pad_token_id} for ids in padding)
    again = all_rows(PackedBatches(tmp_path / "ex.jsonl", tok, 2, 32, shuffle=False))
    assert all(torch.equal(rows[k], again[k]) for k in rows)


def test_best_fit_fills_the_rows(tmp_path, tok):
    """Examples of 20 to 40 tokens in rows of 64: no row left with room for the shortest."""
    write_examples(tmp_path / "ex.jsonl", [random.Random(3).randint(20, 40) for _ in range(200)])
    batches = PackedBatches(tmp_path / "ex.jsonl", tok, 1, 64, shuffle=False)
    rows = all_rows(batches)
    runs = sequences(rows)
    pads = [len(ids) for ids, _, pad in runs if pad]
    assert max(pads) < 20 or pads.count(max(pads)) == 1  # only the window's last row may be emptier


def test_a_batch_counts_its_tokens_padding_and_learnt_labels(tmp_path, tok):
    write_examples(tmp_path / "ex.jsonl", [random.Random(4).randint(3, 30) for _ in range(40)])
    for layout in (Layout(), UNPACKED):
        batches = PackedBatches(tmp_path / "ex.jsonl", tok, 4, 32, seed=3, layout=layout)
        for _ in range(5):
            batch = batches.next_batch()
            runs = sequences(batch.inputs)
            assert batch.slots == 4 * 32
            assert batch.tokens == sum(len(ids) for ids, _, pad in runs if not pad)
            assert batch.learnt == int((batch.inputs["labels"][:, 1:] != IGNORE).sum())


def test_documents_are_masked_from_each_other(tmp_path, tok):
    """Documents concatenated into rows: each one's positions restart and its first label is -100;
    with attention across documents the rows are plain token stream, positions along the row."""
    (tmp_path / "a.txt").write_text("\n\n".join(f"document {i} says {'hello ' * (i % 5)}" for i in range(30)))
    masked = all_rows(PackedBatches(tmp_path / "a.txt", tok, 1, 16, shuffle=False))
    eos = tok.eos_token_id
    ids, labels, pos = (masked[k].flatten().tolist() for k in ("input_ids", "labels", "position_ids"))
    for i in range(1, len(ids)):
        if ids[i - 1] == eos:  # a document starts
            assert pos[i] == 0 and labels[i] == IGNORE
        elif i % 16:
            assert pos[i] == pos[i - 1] + 1 and labels[i] == ids[i]
    crossing = all_rows(PackedBatches(tmp_path / "a.txt", tok, 1, 16, shuffle=False, layout=UNPACKED))
    assert torch.equal(crossing["input_ids"], masked["input_ids"])
    assert torch.equal(crossing["labels"], crossing["input_ids"])
    assert torch.equal(crossing["position_ids"], torch.arange(16).expand_as(crossing["input_ids"]))


@pytest.mark.parametrize("layout", [Layout(), UNPACKED], ids=["packed", "unpacked"])
def test_a_resumed_position_yields_the_batches_of_an_uninterrupted_run(tmp_path, tok, layout):
    write_examples(tmp_path / "ex.jsonl", [random.Random(5).randint(2, 25) for _ in range(80)])
    (tmp_path / "a.txt").write_text("\n\n".join(f"plain text number {i} " * (1 + i % 4) for i in range(20)))
    paths = [tmp_path / "a.txt", tmp_path / "ex.jsonl"]
    straight = PackedBatches(paths, tok, 4, 32, seed=9, layout=layout)
    run = [next(straight) for _ in range(3 * straight.rows_per_epoch // 4)]  # into the third epoch
    first = PackedBatches(paths, tok, 4, 32, seed=9, layout=layout)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PackedBatches(paths, tok, 4, 32, seed=0, layout=layout)
    resumed.load_state_dict(state)
    for want in run[5:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_position_is_resumed_only_with_its_layout(tmp_path, tok):
    write_examples(tmp_path / "ex.jsonl", [6] * 40)
    state = PackedBatches(tmp_path / "ex.jsonl", tok, 2, 32).state_dict()
    with pytest.raises(DataError, match="laid out with --packing on --cross-document-attention, this run lays the "
                                        "data out with --packing off --cross-document-attention; resume with "
                                        "--packing on, or start a fresh run"):
        PackedBatches(tmp_path / "ex.jsonl", tok, 2, 32, layout=UNPACKED).load_state_dict(state)


def legacy_data(folder):
    """Text, ids with labels and prompt/completion records (the same as earlier versions' tests)."""
    (folder / "a.txt").write_text("Rivers carry mud to the sea.\n\nBees make honey in the summer, and ants store "
                                  "grain.\n\n" * 5)
    with open(folder / "b.jsonl", "w") as f:
        for i in range(12):
            n = 3 + (i * 7) % 13
            ids = [5 + (i * 13 + j * 3) % 400 for j in range(n)]
            f.write(json.dumps({"input_ids": ids, "labels": [-100 if j < n // 3 else t for j, t in enumerate(ids)]})
                    + "\n")
    with open(folder / "c.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f" It is {2 * i}."}) + "\n")
    return [folder / "a.txt", folder / "b.jsonl", folder / "c.jsonl"]


def test_packing_off_writes_the_rows_earlier_versions_wrote(tmp_path, tok):
    """--packing off --cross-document-attention: one padded row per example, documents across rows,
    byte for byte the token file of the version before packing (its digest, pinned), so a position
    it saved (no layout in it) resumes."""
    paths = legacy_data(tmp_path)
    batches = PackedBatches(paths, tok, 2, 16, shuffle=False, layout=UNPACKED)
    assert (batches.data_digest, batches.rows_per_epoch) == ("07ca9ac47189483b", 31)
    saved = {"version": 1, "epoch": 0, "row": 4, "seed": 0, "shuffle_from": None, "seq_len": 16,
             "rows_per_epoch": 31, "data_digest": "07ca9ac47189483b"}
    batches.load_state_dict(saved)
    assert batches.packing.examples == batches.packing.example_rows == 18 and not batches.separated
    with pytest.raises(DataError, match="laid out with --packing off --cross-document-attention, .*; resume with "
                                        "--packing off and --cross-document-attention, or start a fresh run"):
        PackedBatches(paths, tok, 2, 16).load_state_dict(saved)


def test_chat_like_data_packs_to_under_5_percent_padding_at_1024(tmp_path, tok):
    """3000 examples shaped like MetaMathQA conversations (mean ~150 tokens, a tail past 400) at
    seq_len 1024: packed, under 5% of the slots are padding; one row each, over 80%."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(135), 0.5, 3000), 30, 480).astype(int)
    assert 130 < lengths.mean() < 170 and lengths.max() > 400
    write_examples(tmp_path / "chat.jsonl", lengths.tolist())
    packed = PackedBatches(tmp_path / "chat.jsonl", tok, 8, 1024)
    assert packed.packing.examples == 3000
    assert packed.packing.pad_fraction < 0.05
    batch = packed.next_batch()
    assert batch.pad_fraction < 0.1
    unpacked = PackedBatches(tmp_path / "chat.jsonl", tok, 8, 1024, layout=UNPACKED)
    assert unpacked.packing.pad_fraction > 0.8 and unpacked.rows_per_epoch == 3000
    line = packed.packing.describe(1024, packed.layout, 0)
    assert line.startswith(f"packing: {packed.rows_per_epoch} rows of 1024 tokens, ")
    assert "3000 examples packed into" in line and "one row each: 3000 rows, 85." in line


def test_an_eval_set_is_read_once_in_order_with_its_last_batch_completed(tmp_path, tok):
    records = write_examples(tmp_path / "ev.jsonl", [10] * 7)
    held = EvalSet(tmp_path / "ev.jsonl", tok, 2, 32, layout=Layout())
    assert held.total == held.steps == 2  # 3 rows in batches of 2
    batches = list(held.batches())
    runs = [s for b in batches for s in sequences(b.inputs) if not s[2]]
    assert sorted(tuple(ids) for ids, _, _ in runs) == sorted(tuple(r["input_ids"]) for r in records)
    assert batches[1].inputs["labels"][1].eq(IGNORE).all() and batches[1].tokens == 10
    assert sum(b.learnt for b in batches) == 7 * (10 - 10 // 3)
    assert EvalSet(tmp_path / "ev.jsonl", tok, 2, 32, layout=Layout(), steps=1).steps == 1


def test_ranks_share_each_packed_batch_and_count_the_global_one(tmp_path, tok):
    """Rank r of 2 reads rows r·B/2 to (r+1)·B/2 of each global batch (NOTE: [Data across ranks] in
    lazytrain/train/data.py), and every rank counts the global batch's tokens and learnt labels."""
    write_examples(tmp_path / "ex.jsonl", [random.Random(6).randint(2, 25) for _ in range(60)])
    whole = PackedBatches(tmp_path / "ex.jsonl", tok, 4, 32, seed=2)
    ranks = [PackedBatches(tmp_path / "ex.jsonl", tok, 4, 32, seed=2, rank=r, world=2) for r in range(2)]
    for _ in range(6):
        want = whole.next_batch()
        got = [r.next_batch() for r in ranks]
        for k in want.inputs:
            assert torch.equal(torch.cat([g.inputs[k] for g in got]), want.inputs[k])
        assert all((g.tokens, g.learnt, g.slots) == (want.tokens, want.learnt, want.slots) for g in got)
    held = [EvalSet(tmp_path / "ex.jsonl", tok, 4, 32, layout=Layout(), rank=r, world=2) for r in range(2)]
    for a, b, w in zip(held[0].batches(), held[1].batches(), EvalSet(tmp_path / "ex.jsonl", tok, 4, 32,
                                                                      layout=Layout()).batches()):
        assert torch.equal(torch.cat([a.inputs["labels"], b.inputs["labels"]]), w.inputs["labels"])
        assert a.learnt == b.learnt == w.learnt


def test_a_position_binds_only_the_layout_its_data_has(tmp_path, tok):
    """Text alone packs no example: a position saved before packing (no layout in it) resumes with
    packing on, as long as documents are laid out as they were (attending across each other)."""
    (tmp_path / "a.txt").write_text("\n\n".join(f"plain text number {i} " * 3 for i in range(40)))
    crossing = Layout(pack_examples=True, mask_documents=False)
    saved = {k: v for k, v in PackedBatches(tmp_path / "a.txt", tok, 2, 16, layout=UNPACKED).state_dict().items()
             if k not in ("packing", "document_mask")}
    PackedBatches(tmp_path / "a.txt", tok, 2, 16, layout=crossing).load_state_dict(saved)
    with pytest.raises(DataError, match="resume with --cross-document-attention, or start"):
        PackedBatches(tmp_path / "a.txt", tok, 2, 16).load_state_dict(saved)
