"""`lazytrain train --resume` from checkpoints whose digests match but whose contents were crafted
(meta.json's sha256 and digest recomputed, as anyone can): nothing in them runs, every field is
checked before anything is applied, the state must be what this run would have saved at that step,
and a run never saves, nor starts from, a state that is not finite. Each refusal is one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from lazytrain.errors import CheckpointError
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint_load import load_latest
from test_resume import finished, one_line_error, run, run_copy, small_model, train_args  # noqa: F401 -- fixtures

STEP4 = "step-00000004"


def reseal(path: Path, edit=None) -> None:
    """meta.json of the checkpoint at `path` with every file's sha256 and its own digest recomputed,
    after `edit(body)`: what someone crafting a checkpoint does."""
    body = json.loads((path / ckpt.META_FILE).read_text())
    body.pop("digest")
    body["files"] = {p.name: ckpt._sha256_file(p) for p in sorted(path.iterdir()) if p.name != ckpt.META_FILE}
    if edit is not None:
        edit(body)
    (path / ckpt.META_FILE).write_text(json.dumps(dict(body, digest=ckpt._meta_digest(body))))


def resave(root: Path, edit) -> None:
    """The latest checkpoint under `root` saved again after `edit(model_state, optimizer_state, extra)`."""
    found = load_latest(root, None)
    model_state, optimizer_state = dict(found.model_state), found.optimizer_state
    extra = json.loads(json.dumps(found.extra))
    edit(model_state, optimizer_state, extra)
    shutil.rmtree(root)
    ckpt.save_checkpoint(root, found.step, model_state=model_state, optimizer_state=optimizer_state, extra=extra,
                         fingerprint=found.fingerprint)


def resume_refused(capsys, model, run_dir, *texts, argv=(), marker: Path | None = None):
    """`--resume` refused with one line holding `texts`; `marker`: a file the checkpoint's payload would create."""
    code, out, err = run(capsys, *train_args(model, run_dir, "--resume", *argv))
    assert marker is None or not marker.exists(), "the checkpoint ran its payload"
    one_line_error(code, err, *texts)
    assert "resumed from" not in out and "step     5" not in out
    return out


# ---- 1. a DCP checkpoint runs nothing it holds -------------------------------------------------------

def to_dcp(root: Path, value_edit=None) -> Path:
    """The latest checkpoint under `root` rewritten in format 2 (torch.distributed.checkpoint, by one
    process, as the ranks of a run save it: NOTE: [Distributed checkpoints]); `value_edit(flat)`
    changes its entries first."""
    import torch.distributed.checkpoint as dcp

    from lazytrain.train.dist_checkpoint import GROUPS, MODEL, STATE

    found = load_latest(root, None)
    flat = {MODEL + name: t for name, t in found.model_state.items()}
    for i, entry in found.optimizer_state["state"].items():
        flat.update({f"{STATE}{i}/{k}": v for k, v in entry.items()})
    for g, group in enumerate(found.optimizer_state["param_groups"]):
        flat.update({f"{GROUPS}{g}/{k}": v for k, v in group.items()})
    if value_edit is not None:
        value_edit(flat)
    new = root / "new"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(new)), no_dist=True)
    torch.save({**found.rng, "ranks": [found.rng]}, new / ckpt.RNG_FILE)
    body = {"format": ckpt.DCP_FORMAT, "step": found.step, "fingerprint": found.fingerprint, "extra": found.extra,
            "model_keys": list(found.model_state), "world_size": 1}
    (new / ckpt.META_FILE).write_text(json.dumps(dict(body, digest="")))
    reseal(new)
    shutil.rmtree(found.path)
    new.rename(found.path)
    return found.path


class Touch:
    """Unpickled, it creates `marker`: through os.system, or through a method of a class DCP's
    metadata does hold (pickle looks up `PosixPath.touch` by getattr)."""

    def __init__(self, marker: Path, how: str):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"touch {self.marker}",)
        return Path.touch, (self.marker,)


def test_a_dcp_checkpoint_of_lazytrains_own_resumes(small_model, run_copy, capsys):
    """The restricted reader takes DCP's own metadata and values: a format-2 checkpoint resumes."""
    to_dcp(run_copy / "checkpoints")
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--resume"))
    assert code == 0, err
    assert f"resumed from {run_copy / 'checkpoints' / STEP4} at step 4" in out


@pytest.mark.parametrize("how, named", [("system", "posix.system"), ("path", "pathlib.Path.touch")])
def test_crafted_dcp_metadata_runs_nothing(small_model, run_copy, tmp_path, capsys, how, named):
    """torch's reader unpickles `.metadata` with plain pickle: the file named here appeared before
    the resume said a word. Now the metadata is read by an unpickler that knows only DCP's classes."""
    path = to_dcp(run_copy / "checkpoints")
    marker = tmp_path / "ran"
    (path / ckpt.DCP_METADATA).write_bytes(pickle.dumps(Touch(marker, how)))
    reseal(path)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} is refused: its .metadata names {named}, which "
                   "DCP metadata never holds (unpickling it could run any code); delete it", marker=marker)


def test_crafted_dcp_value_runs_nothing(small_model, run_copy, tmp_path, capsys):
    """DCP reads a plain value (a hyperparameter) with torch.load(weights_only=False): one holding a
    callable ran it. Now plain values are read with weights_only=True."""
    marker = tmp_path / "ran"

    def plant(flat):
        flat["optimizer/param_groups/0/lr"] = Touch(marker, "system")

    path = to_dcp(run_copy / "checkpoints", plant)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} is refused: its entry "
                   "optimizer/param_groups/0/lr is not a plain value, as lazytrain stores there (UnpicklingError",
                   marker=marker)


def test_dcp_metadata_storing_outside_the_checkpoint_is_refused(small_model, run_copy, capsys):
    """An entry stored in a file the checkpoint does not list (here: outside its directory) is never read."""
    path = to_dcp(run_copy / "checkpoints")
    metadata = pickle.loads((path / ckpt.DCP_METADATA).read_bytes())  # written just now
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../elsewhere.distcp"
    (path / ckpt.DCP_METADATA).write_bytes(pickle.dumps(metadata))
    reseal(path)
    resume_refused(capsys, small_model, run_copy, "its .metadata stores", "in '../../elsewhere.distcp', outside the "
                   "checkpoint's own files")


def test_a_torn_dcp_shard_is_one_line(small_model, run_copy, capsys):
    """DCP raises its failures as a CheckpointException, a BaseException printed with every rank's
    traceback; it ended the run with one. Now the failure it holds is the one line."""
    path = to_dcp(run_copy / "checkpoints")
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    reseal(path)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} cannot be loaded although its checksums match")


# ---- 2. malformed fields: one line, not a traceback ---------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda b: b.pop("step"), "meta.json has no step"),
    (lambda b: b.pop("fingerprint"), "meta.json has no fingerprint"),
    (lambda b: b.pop("files"), "meta.json has no files"),
    (lambda b: b.pop("extra"), "meta.json has no extra"),
    (lambda b: b.update(files="model.safetensors"), "meta.json lists its files' sha256 as a str, not a mapping"),
    (lambda b: b.update(step="4"), "meta.json holds step '4', not a step number"),
], ids=["no-step", "no-fingerprint", "no-files", "no-extra", "files-str", "step-str"])
def test_malformed_meta_fields_are_one_line(small_model, run_copy, capsys, edit, message):
    path = run_copy / "checkpoints" / STEP4
    reseal(path, edit)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} is corrupt: {message}", "delete it")


@pytest.mark.parametrize("field, value, message", [
    ("base_lrs", ["0.003"] * 5, "records scheduler.base_lrs = ['0.003', "),
    ("last_epoch", 4.0, "records scheduler.last_epoch = 4.0, not a step"),
    ("lr_lambdas", [{"__code__": 1}] * 5, "not a list of nulls"),
])
def test_malformed_scheduler_records_are_one_line(small_model, run_copy, capsys, field, value, message):
    def edit(model_state, optimizer_state, extra):
        extra["scheduler"][field] = value
    resave(run_copy / "checkpoints", edit)
    resume_refused(capsys, small_model, run_copy, message)


def test_lr_schedule_record_out_of_range_is_refused(small_model, run_copy, capsys):
    """An LR schedule no flag can give (--lr is at most 1) is not followed."""
    def edit(model_state, optimizer_state, extra):
        extra["lr_schedule"]["lr"] = 5.0
    resave(run_copy / "checkpoints", edit)
    resume_refused(capsys, small_model, run_copy, "records lr_schedule.lr = 5.0, not a learning rate in (0, 1]")


@pytest.mark.parametrize("edit, message", [
    (lambda rng: rng.update(python=list(rng["python"][:1]) + [list(rng["python"][1]), None]),
     "rng.pt holds no python random state (TypeError: state vector must be a tuple)"),
    (lambda rng: rng.update(torch=rng["torch"][:-8]), "rng.pt holds no torch CPU generator state"),
    (lambda rng: rng.update(torch=rng["torch"].float()), "rng.pt holds no torch CPU generator state"),
    (lambda rng: rng.update(ranks="all"), "rng.pt holds the ranks' states as a str"),
], ids=["python-list", "torch-short", "torch-float", "ranks-str"])
def test_malformed_rng_states_are_one_line(small_model, run_copy, capsys, edit, message):
    """Each state is set on a scratch generator while the checkpoint is read, so `restore_rng` cannot fail."""
    path = run_copy / "checkpoints" / STEP4
    rng = torch.load(path / ckpt.RNG_FILE, weights_only=True)
    edit(rng)
    torch.save(rng, path / ckpt.RNG_FILE)
    reseal(path)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} is corrupt: {message}")


# ---- 3. the state is what this run would have saved at that step -----------------------------------

def _base_lrs(m, o, extra):
    extra["scheduler"]["base_lrs"] = [5.0] * len(extra["scheduler"]["base_lrs"])


def _group_lr(m, o, extra):
    o["param_groups"][0]["lr"] = 50.0


def _no_state(m, o, extra):
    o["state"] = {}


def _half_moment(m, o, extra):
    o["state"][3]["exp_avg_sq"] = o["state"][3]["exp_avg_sq"].half()


def _data_row(m, o, extra):
    extra["data"]["row"] = 10**6


def _data_elsewhere(m, o, extra):
    extra["data"]["row"] = 6


@pytest.mark.parametrize("edit, message", [
    (_base_lrs, "holds an LR scheduler peaking at 5, but the run's LR schedule `--lr 0.003 --warmup-steps 1 --steps 4 "
                "--min-lr-ratio 0.1` peaks at 0.003"),
    (_group_lr, "holds optimizer group 0 at lr 50.0, but the run's LR schedule `--lr 0.003 --warmup-steps 1 --steps 4 "
                "--min-lr-ratio 0.1` gives 0.0003 at step 4"),
    (_no_state, "is at step 4 but holds no optimizer state for model.embed_tokens.weight (27 of 27 parameters): their "
                "moments would start again from zero"),
    (_half_moment, "holds the optimizer's exp_avg_sq of model.layers.0.self_attn.q_proj.bias as float16, the optimizer "
                   "keeps it in float32"),
    (_data_row, "holds the data position row 1000000 of epoch 0, past the"),
    (_data_elsewhere, "is at step 4, 8 rows in (4 batches of 2), but its data position (epoch 0, row 6 of"),
], ids=["base-lrs", "group-lr", "no-moments", "moment-dtype", "row-out-of-range", "row-elsewhere"])
def test_state_that_this_run_would_not_have_saved_is_refused(small_model, run_copy, capsys, edit, message):
    """Each was resumed silently: the LR jumped (the loss climbed to 50), the moments restarted, the
    data went on from another row. With --new-lr-schedule the old schedule is still what is checked."""
    root = run_copy / "checkpoints"
    resave(root, edit)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {root / STEP4} {message}", "delete it",
                   argv=("--steps", 6, "--new-lr-schedule"))


def test_8bit_states_are_checked_for_their_layout(tmp_path):
    """bitsandbytes' AdamW8bit state (CPU here; the 8-bit stages step on a GPU in a run): 8-bit
    moments with their maps and block maxima for a large parameter, fp32 ones for a small one. The
    genuine state passes; a moment that lost its block maxima, or became fp32, is refused."""
    bnb = pytest.importorskip("bitsandbytes")
    from lazytrain.train.resume import LrSchedule, check_structure, lr_lambda

    trained = LrSchedule(lr=1e-3, warmup_steps=1, steps=4, min_lr_ratio=0.1)
    model = torch.nn.ParameterDict({"big": torch.nn.Parameter(torch.randn(128, 64)),
                                    "small": torch.nn.Parameter(torch.randn(64))})
    opt = bnb.optim.AdamW8bit([{"params": [model["big"], model["small"]]}], lr=trained.lr)
    opt.add_param_group({"params": []})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(1, 4, 0.1))
    for p in model.values():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    stage = SimpleNamespace(params=("p_big", "p_small"), states="8bit")
    schedule = SimpleNamespace(STAGES=[stage], SHARED=(), OPTIMIZER_STATES="8bit", MASTER_WEIGHTS="fp32",
                               PLACEHOLDERS={"p_big": ("param", "big", (128, 64), "float32"),
                                             "p_small": ("param", "small", (64,), "float32")})
    data = {"version": 1, "epoch": 0, "row": 2, "seed": 0, "shuffle_from": 0, "seq_len": 8, "rows_per_epoch": 10,
            "data_digest": "d"}
    prep = SimpleNamespace(meta_model=model, source=SimpleNamespace(batch_shape=(2, 8)), lr=trained)

    def found(state):
        extra = {"scheduler": json.loads(json.dumps(sched.state_dict())), "data": data, "lr_schedule": trained.record()}
        return ckpt.Checkpoint(step=1, model_state={k: v.detach() for k, v in model.state_dict().items()},
                               optimizer_state=state, extra=extra, rng={}, path=tmp_path / "step-00000001")

    check_structure(found(opt.state_dict()), prep, schedule)  # the genuine state fits
    state = opt.state_dict()
    del state["state"][0]["__bnb_optimizer_quant_state__"]["absmax1"]
    with pytest.raises(CheckpointError, match=r"holds the optimizer state \[.*\] for big, where 8-bit AdamW keeps"):
        check_structure(found(state), prep, schedule)
    state = opt.state_dict()
    quant = state["state"][0]["__bnb_optimizer_quant_state__"]
    quant["state1"] = quant["state1"].float()
    with pytest.raises(CheckpointError, match="holds the optimizer's state1 of big as float32, the optimizer keeps it "
                                              "in uint8"):
        check_structure(found(state), prep, schedule)


# ---- 4. non-finite state: named where it is, never saved -------------------------------------------

def _nan_weight(m, o, extra):
    m["model.layers.0.mlp.up_proj.weight"] = m["model.layers.0.mlp.up_proj.weight"].clone()
    m["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")


def _inf_moment(m, o, extra):
    o["state"][26]["exp_avg_sq"][0, 0] = float("inf")


@pytest.mark.parametrize("edit, message", [
    (_nan_weight, "holds nan in model.layers.0.mlp.up_proj.weight: the run had diverged when it was saved"),
    (_inf_moment, "holds inf in the optimizer's exp_avg_sq of lm_head.weight: the run had diverged"),
], ids=["weight", "moment"])
def test_a_checkpoint_that_is_not_finite_is_refused(small_model, run_copy, capsys, edit, message):
    """Such a checkpoint trained one step and then said "the loss is nan; lower --lr or check the data"."""
    root = run_copy / "checkpoints"
    resave(root, edit)
    resume_refused(capsys, small_model, run_copy, f"checkpoint {root / STEP4} {message}",
                   argv=("--steps", 6, "--new-lr-schedule"))


def to_sharded_dcp(root: Path, edit=None) -> Path:
    """The latest checkpoint under `root` rewritten in the sharded layout of format 2 (by parameter
    name, flattened, the model's weights as the masters: NOTE: [Distributed checkpoints]); `edit(flat)`
    changes its entries first."""
    from lazytrain.runtime.schedule import load_schedule
    from lazytrain.train.dist_checkpoint import MODEL, SHARDED_GROUPS, SHARDED_STATE

    found = load_latest(root, None)
    schedule = load_schedule(root.parent / "schedule.py")
    names = [schedule.PLACEHOLDERS[p][1] for stage in schedule.STAGES for p in stage.params]  # the optimizer's order
    flat = {MODEL + name: t for name, t in found.model_state.items()}
    for i, entry in found.optimizer_state["state"].items():
        flat.update({f"{SHARDED_STATE}{names[i]}/{k}": v.reshape(-1) if k != "step" else v for k, v in entry.items()})
    for g, group in enumerate(found.optimizer_state["param_groups"]):
        flat.update({f"{SHARDED_GROUPS}{g}/{k}": v for k, v in group.items() if k != "params"})
    if edit is not None:
        edit(flat)
    return to_dcp(root, lambda entries: (entries.clear(), entries.update(flat)))


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-moment"])
def test_sharded_moments_are_checked_when_they_are_read(small_model, run_copy, capsys, poisoned):
    """The sharded layout's moments are read only once the trainer is bound; they are checked then,
    before the first step (a finite one resumes)."""
    def poison(flat):
        if poisoned:
            flat["sharded/state/lm_head.weight/exp_avg"] = flat["sharded/state/lm_head.weight/exp_avg"].clone()
            flat["sharded/state/lm_head.weight/exp_avg"][7] = float("nan")

    path = to_sharded_dcp(run_copy / "checkpoints", poison)
    argv = ("--steps", 5, "--new-lr-schedule")
    if not poisoned:
        code, out, err = run(capsys, *train_args(small_model, run_copy, "--resume", *argv))
        assert code == 0 and f"resumed from {path} at step 4" in out and "step     5  loss" in out, err
        return
    resume_refused(capsys, small_model, run_copy, f"checkpoint {path} holds nan in the optimizer's exp_avg of "
                   "lm_head.weight: the run had diverged when it was saved", argv=argv)


def test_model_directory_weights_that_are_not_finite_are_refused(tmp_path, capsys):
    """NaN in a model directory's safetensors: named with its file before the first step."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lazytrain.train.data import builtin_tokenizer

    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model_dir = tmp_path / "qwen"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    builtin_tokenizer().save_pretrained(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()  # save_pretrained's progress
    code, out, err = run(capsys, "train", "--model", str(model_dir), "--batch-size", "2", "--seq-len", "32",
                         "--steps", "1", "--no-progress", "--checkpoint-dir", str(tmp_path / "run"))
    one_line_error(code, err, f"weights {model_dir / 'model.safetensors'} hold nan in "
                   "model.layers.0.mlp.down_proj.weight")
    assert "step     1" not in out and not (tmp_path / "run" / "checkpoints").exists()


def test_a_diverged_run_saves_no_checkpoint_of_it(small_model, tmp_path, capsys):
    """--lr 1 --weight-decay 10 makes the weights non-finite within a dozen steps, before a loss shows
    it: the save of that step stops the run (TrainingError naming the tensor), and LATEST keeps
    naming the last finite checkpoint, which resumes."""
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, *train_args(small_model, run_dir, "--steps", 40, "--lr", 1, "--weight-decay", 10,
                                             "--checkpoint-every", 1))
    one_line_error(code, err, "training diverged, so no checkpoint of step", "lower --lr or --weight-decay")
    step = int(err.split("error: step ")[1].split(":")[0])
    root = run_dir / "checkpoints"
    assert (root / "LATEST").read_text() == f"step-{step - 1:08d}\n" and not (root / f"step-{step:08d}").exists()
    found = load_latest(root, None)
    assert all(torch.isfinite(t).all() for t in found.model_state.values())


def test_moments_that_are_not_finite_are_never_saved(small_model, tmp_path, capsys, monkeypatch):
    """An optimizer state gone non-finite (here made so at the second save) is not written either."""
    from lazytrain.runtime.trainer import Trainer

    real, saves = Trainer.state_dict, []

    def state_dict(self):
        state = real(self)
        saves.append(1)
        if len(saves) == 2:
            state["state"][26]["exp_avg"] = torch.full_like(state["state"][26]["exp_avg"], float("-inf"))
        return state

    monkeypatch.setattr(Trainer, "state_dict", state_dict)
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, *train_args(small_model, run_dir, "--steps", 3, "--checkpoint-every", 1))
    one_line_error(code, err, "step 2: the optimizer's exp_avg of lm_head.weight holds -inf: training diverged")
    assert (run_dir / "checkpoints" / "LATEST").read_text() == "step-00000001\n"


def test_a_diverged_run_on_two_ranks_saves_no_checkpoint_of_it(small_model, tmp_path):
    """The same on 2 ranks, whose saves go through DCP: every rank checks the pieces it holds, and
    all stop with the line rank 0 prints (the launcher's own line follows it)."""
    from test_launch import launch

    run_dir = tmp_path / "run"
    done = launch([str(a) for a in train_args(small_model, run_dir, "--steps", 40, "--lr", 1, "--weight-decay", 10,
                                              "--checkpoint-every", 1)], timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("lazytrain: error: ")]
    assert done.returncode == 2 and len(errors) == 2 and "training diverged, so no checkpoint of step" in errors[0], \
        done.stderr
    assert "Traceback" not in done.stderr and "the launcher stopped the others" in errors[1], done.stderr
    step = int(errors[0].split("error: step ")[1].split(":")[0])
    root = run_dir / "checkpoints"
    assert (root / "LATEST").read_text() == f"step-{step - 1:08d}\n" and not (root / f"step-{step:08d}").exists()
    found = load_latest(root, None)
    assert json.loads((found.path / ckpt.META_FILE).read_text())["format"] == ckpt.DCP_FORMAT
    assert all(torch.isfinite(t).all() for t in found.model_state.values())
