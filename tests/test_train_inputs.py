"""`lazytrain train` inputs checked before compiling: the sequence length against the model's
positions, where `--export-hf` may write, and the data order flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazytrain.cli import main, parser
from lazytrain.train.data import builtin_tokenizer
from lazytrain.train.preflight import EXPORT_MARKER, prepare


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def hf_dir(path: Path, config) -> Path:
    """A model directory of `config` with fresh weights and the shipped tokenizer."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    builtin_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A tiny GPT-2: learned absolute positions, 64 of them."""
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return hf_dir(tmp_path_factory.mktemp("models") / "gpt2", config)


# --------------------------------------------------------------------------- positions


def test_seq_len_past_learned_positions_is_refused_before_compiling(gpt2, capsys):
    """GPT-2 learns one embedding per position: --seq-len 65 of 64 would index past the table at the
    first step (an IndexError traceback, after the compile); it is one line naming the fix."""
    code, out, err = run(capsys, "train", "--model", str(gpt2), "--batch-size", "2", "--seq-len", "65", "--steps", "1")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert (f"--seq-len gives 65 positions, and GPT2LMHeadModel learned 64 (n_positions 64 in {gpt2 / 'config.json'}): "
            "its position embeddings (transformer.wpe) have no row for position 64; pass --seq-len 64 or less") in err
    assert "compiling" not in out


def test_seq_len_equal_to_the_learned_positions_trains(gpt2, capsys):
    """Every one of the 64 positions is used: the run trains."""
    code, out, err = run(capsys, "train", "--model", str(gpt2), "--batch-size", "2", "--seq-len", "64", "--steps", "2",
                         "--no-progress", "--print-every", "1")
    assert code == 0, err
    assert "step     2  loss" in out and "warning" not in out


def test_rotary_model_past_its_trained_length_is_said_once(tmp_path, capsys):
    """A RoPE model runs past max_position_embeddings, but has not learnt those positions: one line
    says so, and the run goes on."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = hf_dir(tmp_path / "qwen", config)
    code, out, err = run(capsys, "train", "--model", str(model), "--batch-size", "2", "--seq-len", "32", "--steps", "1",
                         "--no-progress")
    assert code == 0, err
    assert out.count("warning: --seq-len gives 32 positions, past the 16 that Qwen2ForCausalLM was trained on "
                     "(max_position_embeddings in its config)") == 1
    assert out.index("warning: --seq-len") < out.index("compiling")
    assert "unscaled (no RoPE scaling in its config" in out and '"factor": 2.0' in out


def test_the_warning_names_the_configs_rope_scaling():
    """Past its trained length a RoPE model runs with the scaling its config has: the warning says
    which, or that there is none and the setting that would add one."""
    from transformers import Qwen2Config

    from lazytrain.train.preflight import _rope_scaling

    small = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=16)
    yarn = Qwen2Config(**small, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 16})
    assert _rope_scaling(yarn, 64, 16) == "with its config's RoPE scaling (yarn, factor 4.0)"
    plain = _rope_scaling(Qwen2Config(**small), 100, 16)
    assert plain.startswith("unscaled") and '"factor": 7.0' in plain and "over 100" in plain


# --------------------------------------------------------------------------- --export-hf


def test_export_into_the_model_directory_is_refused(gpt2, tmp_path, capsys):
    """Exporting onto the model the run trains from would overwrite it: refused before compiling
    (through another spelling of the path too), unless --overwrite-export."""
    before = {p.name: p.stat().st_mtime_ns for p in gpt2.iterdir()}
    same = gpt2.parent / "." / gpt2.name
    code, out, err = run(capsys, "train", "--model", str(gpt2), "--batch-size", "2", "--seq-len", "32", "--steps", "1",
                         "--export-hf", str(same))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--export-hf {same} is the --model directory this run trains from: the export would overwrite its "
            "weights and tokenizer; pass another directory, or --overwrite-export to replace them") in err
    assert "compiling" not in out
    assert {p.name: p.stat().st_mtime_ns for p in gpt2.iterdir()} == before


def test_export_into_a_directory_that_is_not_an_export_is_refused(gpt2, tmp_path, capsys):
    """A non-empty directory without the export marker is refused; --overwrite-export replaces
    it, and the marker then lets later exports replace it."""
    out_dir = tmp_path / "mine"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep me")
    argv = ["train", "--model", str(gpt2), "--batch-size", "2", "--seq-len", "32", "--steps", "1", "--no-progress",
            "--export-hf", str(out_dir)]
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--export-hf {out_dir} holds notes.txt, and is not an earlier export (it has no {EXPORT_MARKER}); pass a "
            "new or empty directory, or --overwrite-export to replace it") in err
    code, out, err = run(capsys, *argv, "--overwrite-export")
    assert code == 0, err
    assert f"exported the weights of step 1 to {out_dir}" in out
    assert (out_dir / EXPORT_MARKER).is_file() and (out_dir / "model.safetensors").is_file()
    code, out, err = run(capsys, *argv)  # an earlier export: replaced
    assert code == 0, err


# --------------------------------------------------------------------------- data order


def test_data_order_flag(tmp_path):
    """`lazytrain train` shuffles every epoch from --seed by default; --no-shuffle reads file order."""
    argv = ["train", "--steps", "1", "--data", str(Path(__file__).parents[1] / "lazytrain/train/assets/corpus.txt")]
    shuffled = prepare(parser().parse_args(argv))
    in_order = prepare(parser().parse_args(argv + ["--no-shuffle"]))
    assert shuffled.data.state_dict()["shuffle_from"] == 0
    assert in_order.data.state_dict()["shuffle_from"] is None
    assert not next(shuffled.data)["input_ids"].equal(next(in_order.data)["input_ids"])
