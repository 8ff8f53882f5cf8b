"""`lazytrain train --model DIR` on Hugging Face model directories as `save_pretrained` writes them:
tied and untied embeddings, one safetensors file or shards with their index, a tokenizer beside.

Each run's first loss equals eager PyTorch's on the same tokens with the checkpoint's weights (as
transformers itself loads them), `--export-hf` writes a directory transformers loads with the
trained weights and the training tokenizer, and that directory trains again. Bad directories are
refused before compiling with one line naming the cause and the fix.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lazytrain.cli import main
from lazytrain.train.data import CORPUS_PATH, EOS_TOKEN, PAD_TOKEN, TOKENIZER_PATH, PackedBatches

VOCAB, BATCH, SEQ = 512, 2, 32
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(path):
    """The shipped 512-id tokenizer as a model directory's tokenizer, with a chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))


def save_model(path, arch: str, tied: bool, sharded: bool, dtype=torch.float32):
    """A tiny decoder saved with save_pretrained (shards of at most 50 KB when `sharded`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_cls(config).to(dtype)
    model.save_pretrained(str(path), max_shard_size="50KB" if sharded else "5GB")
    save_tokenizer(path)
    return model


def train(capsys, model_dir, run_dir, *extra):
    code = main(["train", "--model", str(model_dir), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
                 "--steps", "2", "--lr", "1e-3", "--no-progress", "--checkpoint-dir", str(run_dir), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return records, out


def eager_first_loss(model_dir) -> float:
    """transformers' own loading of the directory, on the first batch the run trains on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    batch = next(PackedBatches([CORPUS_PATH], tokenizer, BATCH, SEQ, seed=0, vocab_size=VOCAB))
    with torch.no_grad():  # without the cache a from_pretrained model makes: it would skip the document mask
        return model(**batch, use_cache=False).loss.item()


CASES = [("qwen2", True, False), ("qwen2", False, True), ("llama", True, True), ("llama", False, False)]


@pytest.mark.parametrize("arch,tied,sharded", CASES, ids=[f"{a}-{'tied' if t else 'untied'}-{'sharded' if s else 'single'}"
                                                          for a, t, s in CASES])
def test_train_from_a_checkpoint_export_and_train_again(tmp_path, capsys, arch, tied, sharded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "src"
    save_model(src, arch, tied, sharded)
    assert (src / "model.safetensors.index.json").is_file() == sharded
    if tied:  # save_pretrained keeps one copy of tied weights: the embeddings
        names = set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]) if sharded \
            else set(load_file(str(src / "model.safetensors")))
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names

    out = tmp_path / "out"
    records, printed = train(capsys, src, tmp_path / "run", "--export-hf", str(out))
    assert "loaded" in printed and "cast" not in printed
    assert records[0]["loss"] == pytest.approx(eager_first_loss(src), rel=1e-5, abs=1e-6)

    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-00000002" / "model.safetensors"))
    got = exported.state_dict()
    assert set(got) == set(trained)
    for name, value in trained.items():
        assert torch.equal(got[name], value), name
    assert exported.config.tie_word_embeddings == tied
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == tied
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.chat_template == CHAT_TEMPLATE

    again, _ = train(capsys, out, tmp_path / "run2")
    assert again[0]["loss"] == pytest.approx(eager_first_loss(out), rel=1e-5, abs=1e-6)
    assert again[0]["loss"] != pytest.approx(records[0]["loss"], rel=1e-6)  # the trained weights, not the start


def test_sharded_export_trains_again(tmp_path, capsys):
    """export_hf shards a model larger than max_shard_size; the shards load in transformers and train."""
    from transformers import AutoModelForCausalLM

    from lazytrain.train.export import export_hf

    model = save_model(tmp_path / "src", "qwen2", True, False)
    out = export_hf(model, tmp_path / "out", max_shard_size="50KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    save_tokenizer(out)
    records, _ = train(capsys, out, tmp_path / "run")
    assert records[0]["loss"] == pytest.approx(eager_first_loss(tmp_path / "src"), rel=1e-5, abs=1e-6)


def test_bf16_checkpoint_is_cast_and_said_once(tmp_path, capsys):
    """A bf16 checkpoint under a float32 config loads cast to float32, and the run says so."""
    src = tmp_path / "src"
    save_model(src, "qwen2", True, False, dtype=torch.bfloat16)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "float32"
    (src / "config.json").write_text(json.dumps(config))
    records, printed = train(capsys, src, tmp_path / "run")
    assert printed.count("cast ") == 1 and "from bfloat16 to float32" in printed
    assert records[0]["loss"] == pytest.approx(eager_first_loss(src), rel=1e-5, abs=1e-6)


def test_pretokenised_data_uses_the_model_directorys_tokenizer_and_vocab(tmp_path, capsys):
    """input_ids records are checked against the model's vocabulary (not the shipped tokenizer's 512
    ids), and documents are separated by the model tokenizer's end-of-text id."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "src"
    big = VOCAB * 2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=big, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    Qwen2ForCausalLM(config).save_pretrained(str(src))
    vocab = {f"t{i}": i for i in range(big - 1)} | {EOS_TOKEN: big - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN).save_pretrained(str(src))
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [700 + i, 900 + (i % 50), 5]}) + "\n" for i in range(40)))
    records, _ = train(capsys, src, tmp_path / "run", "--data", str(data))
    assert len(records) == 2


def _refused(capsys, *argv) -> str:
    capsys.readouterr()  # what building the directory printed
    code = main(["train", "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--steps", "1", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "compiling" not in out, (out, err)
    assert err.count("\n") == 1
    return err


def test_directory_without_config(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert "without config.json" in _refused(capsys, "--model", str(tmp_path / "m"))


def test_directory_without_weights(tmp_path, capsys):
    src = tmp_path / "m"
    save_model(src, "qwen2", False, False)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"")
    err = _refused(capsys, "--model", str(src))
    assert "holds config.json but no weights (it holds pytorch_model.bin: only safetensors are read)" in err
    assert "--weights random" in err


def test_missing_shard(tmp_path, capsys):
    src = tmp_path / "m"
    save_model(src, "qwen2", False, True)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = _refused(capsys, "--model", str(src))
    assert f"shard {shard} named by {src / 'model.safetensors.index.json'} does not exist" in err
    assert "download the missing shards" in err


def test_unreadable_index(tmp_path, capsys):
    src = tmp_path / "m"
    save_model(src, "qwen2", False, True)
    (src / "model.safetensors.index.json").write_text("{not json")
    err = _refused(capsys, "--model", str(src))
    assert "index" in err and "cannot be read (JSONDecodeError" in err


def test_checkpoint_directory_without_tokenizer(tmp_path, capsys):
    """The shipped tokenizer does not fit a checkpoint: training it on those ids would be noise."""
    src = tmp_path / "m"
    save_model(src, "qwen2", False, False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    err = _refused(capsys, "--model", str(src))
    assert "holds weights but no tokenizer" in err and "--tokenizer DIR" in err


def test_wrong_shape(tmp_path, capsys):
    src = tmp_path / "m"
    save_model(src, "qwen2", False, False)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, "--model", str(src))
    assert "model.layers.0.mlp.down_proj.weight in" in err and "has shape [32, 64] but the model" in err
    assert "has [32, 48]" in err


def test_tied_checkpoint_under_an_untied_config(tmp_path, capsys):
    src = tmp_path / "m"
    save_model(src, "qwen2", True, False)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (src / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, "--model", str(src))
    assert "lack lm_head.weight" in err and '"tie_word_embeddings": true' in err


def test_old_per_layer_rotary_frequencies_are_ignored(tmp_path, capsys):
    """Older checkpoints saved `rotary_emb.inv_freq` in every layer; the model computes its own."""
    from safetensors.torch import save_file

    src = tmp_path / "m"
    save_model(src, "llama", False, False)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.full((4,), 7.0)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    records, _ = train(capsys, src, tmp_path / "run")
    assert records[0]["loss"] == pytest.approx(eager_first_loss(src), rel=1e-5, abs=1e-6)


def test_unexpected_tensor(tmp_path, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "m"
    save_model(src, "qwen2", False, False)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = _refused(capsys, "--model", str(src))
    assert "hold model.layers.9.mlp.up_proj.weight, which the model built from" in err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_loaded_parameters_own_their_memory(tmp_path):
    """The loaded model holds the checkpoint's values in its own memory, not in views of the shards'
    file mappings (an export into the same directory rewrites those files)."""
    import gc

    from lazytrain.train.source import resolve

    src = tmp_path / "m"
    want = save_model(src, "llama", True, True).state_dict()
    model, casts = resolve(src, BATCH, SEQ, None).materialize()
    gc.collect()
    assert casts == [] and not [line for line in open("/proc/self/maps") if str(src) in line]
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_resident_masters_load_straight_onto_their_device(tmp_path):
    """NOTE: [Masters built in place] in runtime/store.py: the parameters of a schedule's resident
    stages and its shared weights are made where `places` puts them (here the meta device, standing
    in for a GPU), one tensor at a time; the streamed ones in host memory, with the checkpoint's
    values; tied names stay one parameter."""
    from lazytrain import hardware
    from lazytrain.ir.model_file import build_on_meta
    from lazytrain.pipeline import analyse
    from lazytrain.runtime.schedule import load_source
    from lazytrain.runtime.store import resident_targets
    from lazytrain.train.source import resolve
    from models import unique_name
    from plans import decisions, forced

    src = tmp_path / "m"
    want = save_model(src, "llama", True, False).state_dict()
    source = resolve(src, BATCH, SEQ, None)
    hw = hardware.load("cpu")
    meta = build_on_meta(source.build_model)
    graph, stages = analyse(meta, source.example_batch(), hw)
    spec = ["-rk"] * len(stages)
    spec[1] = "SRk"  # the first decoder layer streamed, the rest resident
    module = load_source(forced(graph, stages, source.example_batch(), decisions(spec), hw).source_text, unique_name())
    resident = resident_targets(module)
    streamed_names = {module.PLACEHOLDERS[p][1] for s in module.STAGES if s.placement.streamed for p in s.params}
    assert streamed_names and resident and not resident & streamed_names
    model, _ = source.materialize(places=dict.fromkeys(resident, torch.device("meta")))
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in streamed_names:
            assert p.device.type == "cpu" and torch.equal(p, want[name]), name
        else:
            assert p.device.type == "meta", name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bind_names_the_gpu_it_means(monkeypatch):
    """Masters loaded onto "cuda:N" must compare equal to the device bind runs on (given as "cuda"),
    or the store would make a second device copy of each (NOTE: [Masters built in place])."""
    from lazytrain.runtime.trainer import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed(torch.device("cuda")) == torch.device("cuda:1")
    assert indexed(torch.device("cuda:0")) == torch.device("cuda:0")
    assert indexed(torch.device("cpu")) == torch.device("cpu")


def _tiny_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config)


def test_moe_checkpoint_in_the_hub_layout_names_the_conversion(tmp_path, capsys):
    """transformers 5 saves MoE experts one tensor per expert and fuses them when loading; lazytrain
    does not convert, and says how to convert once."""
    src = tmp_path / "m"
    _tiny_moe().save_pretrained(str(src))
    save_tokenizer(src)
    err = _refused(capsys, "--model", str(src))
    assert "in the layout transformers converts when loading" in err
    assert "save_pretrained(NEW, save_original_format=False)" in err


def test_moe_export_loads_in_transformers_and_in_lazytrain(tmp_path):
    from transformers import AutoModelForCausalLM

    from lazytrain.train.export import export_hf
    from lazytrain.train.source import resolve

    model = _tiny_moe()
    out = export_hf(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items())
    loaded, _ = resolve(out, BATCH, SEQ, None).materialize()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
