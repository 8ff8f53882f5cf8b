"""`lazytrain train --model DIR` reads a checkpoint's keys as transformers does (NOTE: [Checkpoint
names] in train/weights.py).

GPT-NeoX saves its output embeddings as `embed_out.weight` (the module is `lm_head`), Granite MoE its
experts as `block_sparse_moe.input_linear.weight` (the module holds `experts.gate_up_proj`):
`save_pretrained` renames them, `from_pretrained` renames them back. Such a directory trains from
its own weights (the first loss is transformers' own), and its export holds the checkpoint's names
again, which `from_pretrained` loads as the trained weights.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_hf_model import SEQ, VOCAB, _refused, eager_first_loss, save_tokenizer, train


def save_family(path, family: str):
    """A tiny model of `family` saved with save_pretrained, with the shipped tokenizer."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=SEQ)
    if family == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**common)
    else:
        model = transformers.GraniteMoeForCausalLM, transformers.GraniteMoeConfig(
            num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, **common)
    torch.manual_seed(0)
    model = model[0](model[1])
    model.save_pretrained(str(path))
    save_tokenizer(path)
    return model


RENAMED = {"gpt_neox": "embed_out.weight", "granitemoe": "model.layers.0.block_sparse_moe.input_linear.weight"}


@pytest.mark.parametrize("family", sorted(RENAMED))
def test_renamed_checkpoint_trains_and_exports_under_its_own_names(tmp_path, capsys, family):
    from transformers import AutoModelForCausalLM

    src, out, run = tmp_path / "src", tmp_path / "out", tmp_path / "run"
    model = save_family(src, family)
    saved = set(load_file(str(src / "model.safetensors")))
    assert RENAMED[family] in saved and RENAMED[family] not in model.state_dict()

    records, printed = train(capsys, src, run, "--export-hf", str(out))
    assert f"loaded {len(saved)} tensors" in printed
    assert records[0]["loss"] == pytest.approx(eager_first_loss(src), rel=1e-5, abs=1e-6)

    assert set(load_file(str(out / "model.safetensors"))) == saved  # what from_pretrained reads
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).state_dict()
    trained = load_file(str(run / "checkpoints" / "step-00000002" / "model.safetensors"))
    assert set(exported) == set(trained)
    for name, value in trained.items():
        assert torch.equal(exported[name], value), name
    start = model.state_dict()
    assert not all(torch.equal(start[name], value) for name, value in trained.items())  # it did train


def test_two_names_for_one_parameter_are_refused(tmp_path, capsys):
    """A checkpoint holding both the saved and the module's name of one tensor is ambiguous."""
    src = tmp_path / "m"
    save_family(src, "gpt_neox")
    state = load_file(str(src / "model.safetensors"))
    state["lm_head.weight"] = state["embed_out.weight"].clone()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = _refused(capsys, "--model", str(src))
    assert "hold both embed_out.weight and lm_head.weight, which are both the model's lm_head.weight" in err


def test_misnamed_tensor_is_named_as_the_checkpoint_holds_it(tmp_path, capsys):
    """A shape mismatch under a renamed key names the checkpoint's key and the model's."""
    src = tmp_path / "m"
    save_family(src, "gpt_neox")
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = VOCAB * 2
    (src / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, "--model", str(src))
    assert f"embed_out.weight (the model's lm_head.weight) in {src / 'model.safetensors'} has shape [{VOCAB}, 32]" in err
