"""The masters are what the schedule says, whatever dtype the model was built in (NOTE: [Masters in
the schedule's dtype] in runtime/optim.py), so a checkpoint never changes what training does next.

For each precision, one run saves a checkpoint after every step and another only at its end: their
losses, final weights and optimizer states are bit-identical. A bf16 checkpoint trains with bf16
masters by default (the schedule header says so) and with fp32 masters under
`--master-weights fp32` (the checkpoint then holds them in fp32).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from lazytrain.cli import main
from test_hf_model import save_model

STEPS = 4
CASES = {  # name: (the checkpoint's dtype, extra flags, the masters the schedule must name, their dtype)
    "fp32": (torch.float32, (), "fp32", torch.float32),
    "fp32-bf16-masters": (torch.float32, ("--master-weights", "bf16"), "bf16", torch.bfloat16),
    "bf16": (torch.bfloat16, (), "bf16", torch.bfloat16),
    "bf16-fp32-masters": (torch.bfloat16, ("--master-weights", "fp32"), "fp32", torch.float32),
    "bf16-8bit": (torch.bfloat16, ("--optimizer-states", "8bit"), "bf16", torch.bfloat16),
}


def _run(capsys, model_dir, run_dir, every: int, *extra):
    code = main(["train", "--model", str(model_dir), "--batch-size", "2", "--seq-len", "32", "--steps", str(STEPS),
                 "--lr", "1e-3", "--no-progress", "--checkpoint-dir", str(run_dir), "--checkpoint-every", str(every),
                 *extra])
    _, err = capsys.readouterr()
    assert code == 0, err
    losses = [json.loads(line)["loss"] for line in (run_dir / "log.jsonl").read_text().splitlines()]
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    return losses, load_file(str(final / "model.safetensors")), torch.load(final / "optimizer.pt"), run_dir


@pytest.mark.parametrize("case", list(CASES))
def test_saving_every_step_trains_as_saving_never(tmp_path, capsys, case):
    dtype, extra, masters, master_dtype = CASES[case]
    save_model(tmp_path / "src", "llama", False, False, dtype=dtype)
    losses, weights, optimizer, run = _run(capsys, tmp_path / "src", tmp_path / "every", 1, *extra)
    assert f"{masters} master weights" in (run / "schedule.py").read_text()
    assert all(t.dtype == master_dtype for t in weights.values() if t.is_floating_point())
    losses_never, weights_never, optimizer_never, _ = _run(capsys, tmp_path / "src", tmp_path / "never", 50, *extra)
    assert losses == losses_never
    assert weights.keys() == weights_never.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, weights_never[name]), name
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            other = optimizer_never["state"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (index, key)


def test_bind_keeps_fp32_masters_of_a_bf16_model(tmp_path):
    """An fp32-master schedule bound to a model built in bf16 makes its parameters fp32: the masters
    the plan counted, which `state_dict()` and checkpoints then hold."""
    from lazytrain.pipeline import compile_model
    from lazytrain.runtime.schedule import load_source
    from test_hf_model import VOCAB

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long)
    compiled = compile_model(meta, {"input_ids": ids, "labels": ids}, 1 << 40, "cpu", master_weights="fp32")
    schedule = load_source(compiled.source_text, "lt_test_fp32_masters_of_bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    schedule.bind(model, lr=1e-3)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == (torch.float32 if tensor.is_floating_point() else before[name].dtype), name
        assert torch.equal(tensor, before[name].to(tensor.dtype)), name
