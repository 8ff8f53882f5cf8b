"""`lazytrain train` with packed examples: the packing summary, honest throughput (NOTE: [Honest
throughput] in lazytrain/train/report.py) and its model FLOPs (NOTE: [Model FLOPs] in
lazytrain/train/flops.py), `--eval-data` through the compiled step (NOTE:
[Evaluation through the training step] in lazytrain/train/evaluation.py), and models that cannot
keep packed sequences apart refused before compiling (NOTE: [Document boundaries reach attention]
in lazytrain/train/boundaries.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lazytrain.cli import main
from lazytrain.train.data import PackedBatches
from lazytrain.train.evaluation import EvalSet
from lazytrain.train.packing import Layout
from test_hf_model import save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB, BATCH, SEQ = 512, 2, 64
LAYERS, WIDTH = 2, 32  # the model's attention: 4 heads of 8
IGNORE = -100


def model_dir(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64,
                                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=SEQ)).save_pretrained(str(path))
    save_tokenizer(path)
    return path


def causal_pairs(batch: dict) -> int:
    """The (query, key) pairs causal attention inside each sequence computes, over the tokens that
    are no padding (a row's padding: its last run of positions, when it learns nothing)."""
    total = 0
    for labels, pos in zip(batch["labels"].tolist(), batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [SEQ]
        if all(x == IGNORE for x in labels[starts[-2]:]):
            starts.pop()  # the tokens end where the padding starts
        total += sum((b - a) * (b - a + 1) // 2 for a, b in zip(starts, starts[1:]))
    return total


def examples(path: Path, n: int, start: int = 0) -> Path:
    records = [{"prompt": f"What is {i} plus {2 * i}?" + " Think step by step." * (i % 3),
                "completion": f" It is {3 * i}." + " Yes." * (i % 4)} for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return model_dir(root / "src"), examples(root / "train.jsonl", 48), examples(root / "eval.jsonl", 9, 100)


def train(capsys, src, run_dir, *extra) -> tuple[list[dict], str]:
    code = main([str(a) for a in ("train", "--model", src, "--batch-size", BATCH, "--seq-len", SEQ, "--lr", "1e-3",
                                  "--no-progress", "--print-every", 1, "--checkpoint-dir", run_dir, *extra)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()], out


def eager_eval_loss(src: Path, weights: Path, eval_data: Path) -> float:
    """The eval set's mean loss over its learnt tokens, each example run alone in eager PyTorch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype=torch.float32)
    model.load_state_dict(load_file(str(weights)))
    tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in EvalSet(eval_data, tokenizer, BATCH, SEQ, layout=Layout()).batches():
            for ids, labels, pos in zip(*(batch.inputs[k] for k in ("input_ids", "labels", "position_ids"))):
                starts = (pos == 0).nonzero().flatten().tolist() + [SEQ]
                for a, b in zip(starts, starts[1:]):
                    n = int((labels[a + 1 : b] != IGNORE).sum())
                    if n:
                        total += model(input_ids=ids[None, a:b], labels=labels[None, a:b], use_cache=False).loss.item() * n
                        count += n
    return total / count


def test_a_packed_run_reports_real_tokens_and_evaluates_without_touching_training(tmp_path, capsys, setup):
    src, data, held_out = setup
    records, out = train(capsys, src, tmp_path / "run", "--steps", 3, "--data", data, "--eval-data", held_out,
                         "--eval-every", 2, "--checkpoint-every", 2)
    assert "packing: " in out and "48 examples packed into " in out and "one row each: 48 rows" in out
    assert re.search(r"^eval: \d+ rows of 64 tokens from .*eval.jsonl, \d+ batches an evaluation \(the whole eval set\)$",
                     out, re.M)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    batches = PackedBatches(data, tokenizer, BATCH, SEQ, vocab_size=VOCAB)
    n_params = sum(t.numel() for t in load_file(str(src / "model.safetensors")).values())
    padded = 0
    for record in records:  # the same batches the run read: their counts, not the slots
        batch = batches.next_batch()
        padded += batch.tokens < BATCH * SEQ
        assert record["tokens_per_s"] * record["step_s"] == pytest.approx(batch.tokens, rel=1e-9)
        # 6N per token plus each layer's attention over the batch's own sequences (NOTE: [Model FLOPs])
        assert record["tflops_counts_attention"] is True
        assert record["tflops"] * record["step_s"] * 1e12 == pytest.approx(
            6 * n_params * batch.tokens + 14 * LAYERS * WIDTH * causal_pairs(batch.inputs), rel=1e-9)
        assert record["pad_fraction"] == pytest.approx(batch.pad_fraction) and record["learnt_tokens"] == batch.learnt
    assert padded  # some padding was left out
    # the directory's Qwen2 attends through the document attention operator (NOTE: [Document attention])
    assert "torch.ops.lazytrain.document_attention.default(" in (tmp_path / "run" / "schedule.py").read_text()
    assert [("eval_loss" in r) for r in records] == [False, True, True]  # every 2 steps, and after the last
    assert "eval at step 2: loss " in out and "eval at step 3: loss " in out
    weights = tmp_path / "run" / "checkpoints" / "step-00000002" / "model.safetensors"
    assert records[1]["eval_loss"] == pytest.approx(eager_eval_loss(src, weights, held_out), rel=1e-5)

    plain, _ = train(capsys, src, tmp_path / "plain", "--steps", 3, "--data", data, "--checkpoint-every", 2)
    assert [r["loss"] for r in plain] == [r["loss"] for r in records]  # bit for bit
    for step in ("step-00000002", "step-00000003"):
        a, b = (load_file(str(tmp_path / d / "checkpoints" / step / "model.safetensors")) for d in ("run", "plain"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_packing_off_reports_its_padding(tmp_path, capsys, setup):
    src, data, _ = setup
    records, out = train(capsys, src, tmp_path / "run", "--steps", 1, "--data", data, "--packing", "off")
    assert "48 examples one to a row (--packing off)" in out
    assert records[0]["pad_fraction"] > 0.3


TINY_GPT = (ROOT / "lazytrain/examples/tiny_gpt.py").read_text()


def refused(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_models_that_cannot_keep_packed_sequences_apart_are_refused(tmp_path, capsys, setup):
    _, data, _ = setup
    tokenizer = setup[0]
    plain = tmp_path / "plain.py"  # a module that never reads position_ids
    plain.write_text(TINY_GPT.replace("= 96, 32, 4, 3, 16, 2", "= 512, 32, 4, 3, 64, 2"))
    err = refused(capsys, "train", "--model", plain, "--data", data, "--tokenizer", tokenizer, "--steps", 1)
    assert ("example_batch() in " in err and "has no position_ids, so examples packed several to a row (--packing on, "
            "the default) would see each other; pass --packing off, or add position_ids (int64 [2, 64]) to "
            "example_batch()") in err

    ignoring = tmp_path / "ignoring.py"  # position_ids in its batch, attention causal whatever they say
    ignoring.write_text(plain.read_text().replace("def forward(self, input_ids, labels):",
                                                  "def forward(self, input_ids, labels, position_ids):")
                        .replace('return {"input_ids": ids, "labels": ids.clone()}',
                                 'return {"input_ids": ids, "labels": ids.clone(), "position_ids": ids.clone()}'))
    err = refused(capsys, "train", "--model", ignoring, "--data", data, "--tokenizer", tokenizer, "--steps", 1)
    assert (f"{ignoring}: attention aten.scaled_dot_product_attention.default in blocks.0 takes no mask computed from "
            "position_ids, so sequences packed into one row would see each other; pass --packing off") in err

    code = main([str(a) for a in ("train", "--model", plain, "--data", data, "--tokenizer", tokenizer, "--steps", 1,
                                  "--packing", "off", "--no-progress")])
    assert code == 0, capsys.readouterr().err
    code = main([str(a) for a in ("train", "--model", plain, "--steps", 1, "--no-progress")])  # text documents
    out = capsys.readouterr().out
    assert code == 0 and (f"note: example_batch() in {plain} has no position_ids, so the documents concatenated into "
                          "a row attend to each other (as with --cross-document-attention), or add position_ids") in out


def test_eval_flags_need_eval_data(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--eval-every", "5"])
    assert "--eval-every sets how --eval-data is evaluated; pass --eval-data FILES with it" in capsys.readouterr().err
