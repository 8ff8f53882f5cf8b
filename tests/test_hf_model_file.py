"""A model file whose `build_model()` builds a Hugging Face model with its config's default
`use_cache=True` trains, compiled ahead (`lazytrain compile`, then `train --schedule`) or on the
fly (`train --model model.py`): capture traces it without its key/value cache (NOTE: [No KV cache
in a training step] in ir/capture.py), and leaves the model's config as it was.
"""

import json

import torch

from lazytrain.cli import main
from lazytrain.ir.capture import capture
from lazytrain.ir.model_file import build_on_meta, load_model_file

MODEL = '''
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def build_model():
    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return Qwen2ForCausalLM(config)


def example_batch():
    ids = torch.zeros(2, 32, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}
'''


def _train(capsys, run_dir, *argv):
    code = main(["train", "--steps", "2", "--lr", "1e-3", "--no-progress", "--checkpoint-dir", str(run_dir), *argv])
    _, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line)["loss"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_model_file_with_the_cache_on_trains_compiled_and_on_the_fly(tmp_path, capsys):
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL)
    build_model, example_batch = load_model_file(model_file)
    model = build_on_meta(build_model)
    assert model.config.use_cache
    graph = capture(model, example_batch())
    assert model.config.use_cache  # put back after the trace
    assert not [n.target for n in graph.nodes if "lifted_tensor" in n.target]

    schedule = tmp_path / "schedule.py"
    assert main(["compile", str(model_file), "-o", str(schedule), "--budget", "4GiB", "--hardware", "cpu"]) == 0
    compiled = _train(capsys, tmp_path / "run1", "--model", str(model_file), "--schedule", str(schedule))
    on_the_fly = _train(capsys, tmp_path / "run2", "--model", str(model_file))
    assert len(compiled) == 2 and all(torch.isfinite(torch.tensor(compiled)))
    assert compiled == on_the_fly  # the same model, weights and data either way
