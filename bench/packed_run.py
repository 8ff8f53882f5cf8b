"""Packed chat data against full rows and one row per example, through `lazytrain train`.

The user's path: a Qwen2.5-7B-shaped checkpoint directory (config.json in bf16, random weights in
one safetensors file, the shipped tokenizer), `lazytrain train --model DIR` at 32 x 1024 and a
24 GiB budget with 8-bit states and bf16 masters, on three inputs:

* `full`: the shipped text corpus (four copies: one is less than a batch), every row full, documents attending across each other
  (`--cross-document-attention`): the step on full rows, plain causal attention;
* `packed`: a MetaMathQA-like set of labelled examples (`chat_lengths`: mean about 157 tokens,
  a tail to 409; the prompt, a third of each, not learnt), packed (the default): the schedule
  compiled with position_ids and the document attention operator;
* `unpacked`: the same set with `--packing off`, one padded row per example.

Each runs `--steps` steps; the table gives the medians of the steps after `--warmup` of
`step_s`, of tokens/s over non-padding tokens and TFLOPS of model FLOPs, attention counted over
each case's own sequences (as `log.jsonl` reports them: NOTE: [Model FLOPs] in flops.py), and
the padding fraction. The machine without a GPU compiles the two schedules (it has the solver):

    python bench/packed_run.py compile            # here: .bench/packed/{causal,documents}.py, chat.jsonl
    python bench/packed_run.py run --out DIR      # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / ".bench" / "packed"
NAME, BATCH, SEQ, BUDGET = "qwen2.5-7b", 32, 1024, "24GiB"
IGNORE = -100


def chat_lengths(n: int, seed: int = 0) -> list[int]:
    """Example lengths shaped like MetaMathQA chats: most short (log-normal about 110 tokens), one
    in seven long (300-409), so a mean near 157 with a tail to 409."""
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(105), 0.45, n), 28, 409)
    long = rng.integers(300, 410, n)
    return np.where(rng.random(n) < 0.15, long, short).astype(int).tolist()


def write_chat(path: Path, n: int = 6000) -> None:
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for length in chat_lengths(n):
            ids = rng.integers(10, 500, length).tolist()  # inside the shipped tokenizer's 512 ids
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE if i < length // 3 else t for i, t in enumerate(ids)]})
                    + "\n")


def compile_schedules() -> None:
    sys.path.insert(0, str(ROOT))
    from bench import shapes
    from lazytrain.kernels import documents
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import compile_model
    from lazytrain.units import parse_size

    HERE.mkdir(parents=True, exist_ok=True)
    write_chat(HERE / "chat.jsonl")
    lengths = [len(json.loads(line)["input_ids"]) for line in open(HERE / "chat.jsonl")]
    print(f"chat.jsonl: {len(lengths)} examples, mean {np.mean(lengths):.0f} tokens, p90 "
          f"{np.percentile(lengths, 90):.0f}, max {max(lengths)}")
    options = CompileOptions(budget=parse_size(BUDGET), optimizer_states="8bit", master_weights="bf16")
    for name, attention in (("causal", None), ("documents", documents.register())):
        model = shapes.meta_model(NAME, SEQ).to(torch.bfloat16)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if attention:
            model.set_attn_implementation(attention)
            batch["position_ids"] = ids.clone()
        start = time.perf_counter()
        compiled = compile_model(model, batch, hardware="h200", options=options, source=f"{NAME} ({name})")
        (HERE / f"{name}.py").write_text(compiled.source_text)
        print(f"{name}: compiled in {time.perf_counter() - start:.0f} s")


def make_checkpoint(directory: Path) -> None:
    """config.json (bf16), random weights filled on the GPU, the shipped tokenizer."""
    from safetensors.torch import save_file

    from bench import shapes
    from lazytrain.train.data import EOS_TOKEN, PAD_TOKEN, TOKENIZER_PATH
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    config = shapes.config(NAME, SEQ)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(directory))
    model = shapes.build(NAME, SEQ, "cuda", torch.bfloat16)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    del model
    torch.cuda.empty_cache()
    PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
                            ).save_pretrained(str(directory))


# The GPU machine has no `datasets`, which lazytrain reads .jsonl files with: the runs there get
# this stand-in, which streams the JSON lines as columns (the step, which is what is timed, does
# not see the difference). Where `datasets` is installed it is used.
_DATASETS_STANDIN = """
import json, types
logging = types.SimpleNamespace(get_verbosity=lambda: 0, set_verbosity=lambda level: None)
utils = types.SimpleNamespace(logging=types.SimpleNamespace(is_progress_bar_enabled=lambda: False))
disable_progress_bars = enable_progress_bars = lambda: None
class _Lines:
    column_names = None
    def __init__(self, path): self.path = path
    def select_columns(self, keep): return self
    def iter(self, batch_size):
        rows = [json.loads(line) for line in open(self.path) if line.strip()]
        for i in range(0, len(rows), batch_size):
            part = rows[i:i + batch_size]
            yield {k: [r.get(k) for r in part] for k in part[0]}
def load_dataset(builder, data_files, split, streaming, cache_dir, **options):
    assert builder == "json", builder
    return _Lines(data_files)
"""


def _environment() -> dict:
    env = dict(os.environ)
    try:
        import datasets  # noqa: F401
    except ImportError:
        shim = Path(os.environ.get("TMPDIR", "/tmp")) / "standin"
        (shim / "datasets").mkdir(parents=True, exist_ok=True)
        (shim / "datasets" / "__init__.py").write_text(_DATASETS_STANDIN)
        env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{shim}"
        print("note: no datasets here: the runs read the .jsonl through a stand-in", flush=True)
    return env


def run(out: Path, steps: int, warmup: int, only: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    ckpt = tmp / "qwen7b_ckpt"
    start = time.perf_counter()
    make_checkpoint(ckpt)
    print(f"checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
    chat = HERE / "chat.jsonl"
    if not chat.exists():
        write_chat(chat)
    from lazytrain.train.data import CORPUS_PATH

    text = tmp / "corpus_x4.txt"  # the shipped corpus holds fewer tokens than one 32 x 1024 batch
    text.write_text(Path(CORPUS_PATH).read_text() * 4)
    env = _environment()
    cases = {"full": ("causal", ["--data", text, "--cross-document-attention"]),
             "packed": ("documents", ["--data", chat]),
             "unpacked": ("causal", ["--data", chat, "--packing", "off"])}
    rows = {}
    for case, (schedule, extra) in cases.items():
        if only and case not in only:
            continue
        log = out / f"{case}.jsonl"
        cmd = [sys.executable, "-m", "lazytrain", "train", "--model", ckpt, "--schedule", HERE / f"{schedule}.py",
               "--batch-size", BATCH, "--seq-len", SEQ, "--steps", steps, "--log", log, "--overwrite-log",
               "--no-progress", "--print-every", 1, *extra]
        start = time.perf_counter()
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
        tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
        print(f"--- {case} ({time.perf_counter() - start:.0f} s, exit {done.returncode})\n" + "\n".join(tail), flush=True)
        if done.returncode != 0:
            continue
        records = [json.loads(line) for line in log.read_text().splitlines()][warmup:]
        rows[case] = {key: statistics.median(r[key] for r in records)
                      for key in ("step_s", "tokens_per_s", "tflops", "pad_fraction")}
        rows[case]["steps"] = len(records)
    (out / "packed_run.json").write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                     "device": torch.cuda.get_device_name()}, indent=1))
    full = rows.get("full", {}).get("tokens_per_s")
    print(f"\n{NAME} {BATCH}x{SEQ}, {BUDGET}, 8-bit states, bf16 masters; medians of {steps - warmup} steps after "
          f"{warmup}; tokens are non-padding")
    print(f"{'case':<10}{'step s':>8}{'tokens/s':>10}{'TFLOPS':>8}{'padding':>9}{'x full':>8}")
    for case, r in rows.items():
        ratio = f"{r['tokens_per_s'] / full:.2f}" if full else "-"
        print(f"{case:<10}{r['step_s']:>8.3f}{r['tokens_per_s']:>10.0f}{r['tflops']:>8.1f}{r['pad_fraction']:>9.1%}"
              f"{ratio:>8}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("compile", "run"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "packed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", nargs="*", default=[])
    a = p.parse_args()
    if a.what == "compile":
        compile_schedules()
    else:
        run(a.out, a.steps, a.warmup, a.only)


if __name__ == "__main__":
    main()
