"""Ranks for the data-parallel tests (test_data_parallel.py): a launcher that spawns N processes in a
gloo group, and the per-rank checks it runs. A module of its own so spawned processes can import
the functions by name.

Every rank binds the schedule to its own copy of the same model and steps on its rows of a global
batch; the reference is single-process eager PyTorch on the whole global batch.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import queue as queue_mod
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lazytrain.errors import DistributedError, ScheduleMismatch
from lazytrain.runtime.schedule import load_source
from checks import assert_grads_match, eager_grads
from models import hf_config, hf_pair, model_pair, tiny_gpt_pair, token_batch, unique_name

# eps 1e-3, not torch's 1e-8: Adam divides by sqrt(v) + eps, so a small eps turns gradients that are
# rounding noise (attention's key bias: softmax ignores a shift), which differ with the reduction's
# order, into lr-sized updates; and a larger eps makes the update depend on the gradient's scale, so
# ranks that summed instead of averaging would show in the weights, not only in the gradients.
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.05)
STEPS = 3


# ---- launcher ------------------------------------------------------------------------------------

def _entry(rank: int, world: int, store: str, fn, args, results, timeout_s: float):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown of a group another rank may have left broken


def launch(fn, *args, world: int = 2, timeout_s: float = 60.0, deadline_s: float = 240.0) -> dict[int, object]:
    """Run `fn(rank, world, *args)` on `world` spawned ranks of a gloo group whose collectives time
    out after `timeout_s`. Returns {rank: result} of the ranks that reported one (a rank may exit
    early on purpose); a rank that raised fails the caller with its traceback. Never waits past
    `deadline_s`: ranks still running then are killed and reported as hung."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, args, results, timeout_s)) for r in range(world)]
        for p in procs:
            p.start()
        out, errors = {}, []
        end = time.monotonic() + deadline_s
        while len(out) + len(errors) < world and any(p.is_alive() for p in procs) or not results.empty():
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            except queue_mod.Empty:
                if time.monotonic() > end:
                    break
                continue
            (out.__setitem__(rank, value) if status == "ok" else errors.append(f"rank {rank}:\n{value}"))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    if hung and time.monotonic() > end:
        raise AssertionError(f"ranks {hung} still ran after {deadline_s:g} s: a collective hung")
    return out


# ---- models and batches --------------------------------------------------------------------------

def pair(name: str):
    """(meta, real, one rank's batch) of a test model. "qwen2_tied": tied embeddings (`_qwen2_tied`);
    "qwen2_tied8" the same with a vocabulary of 145: an embedding of 4640 elements, which 8-bit states
    quantise in 18 blocks of 256 and a 32-element tail, and whose halves (2320) are not whole blocks."""
    if name == "tiny_gpt":
        return tiny_gpt_pair()
    if name == "qwen2":
        return hf_pair("qwen2", layers=2)
    if name == "qwen2_tied":
        return _qwen2_tied()
    if name == "qwen2_tied8":
        return _qwen2_tied(vocab=145)
    raise ValueError(name)


def _qwen2_tied(vocab: int = 128):
    """A tiny Qwen2 with tie_word_embeddings: the embedding is a shared parameter and the prologue (the
    embedding alone) has none of its own."""
    from transformers import Qwen2ForCausalLM

    cfg = hf_config("qwen2", layers=2, vocab=vocab)
    cfg.tie_word_embeddings = True
    meta, real = model_pair(lambda: Qwen2ForCausalLM(cfg))
    return meta, real, token_batch(2, 8, cfg.vocab_size)


def global_batch(name: str, world: int, seed: int, ragged: bool = False) -> dict[str, torch.Tensor]:
    """`world` ranks' batches, stacked along rows; every row has the same number of targets, or with
    `ragged` labels ignored (-100) so unevenly that the ranks learn very different numbers of tokens:
    the first rank's rows keep a target or two (none at all when `seed` is odd), the last rank's all."""
    _, _, batch = pair(name)
    rows, seq = batch["input_ids"].shape
    vocab = {"tiny_gpt": 96, "qwen2": 128, "qwen2_tied": 128, "qwen2_tied8": 145}[name]
    glob = token_batch(world * rows, seq, vocab, seed=seed)
    if ragged:
        labels = glob["labels"]
        for r in range(world * rows):
            rank = r // rows
            keep = 0 if rank == 0 and seed % 2 else 1 + r % 2 if rank == 0 else seq * rank // (world - 1)
            labels[r, : seq - keep] = -100
    return glob


def rows_of(batch: dict, rank: int, world: int) -> dict:
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out


def bind(source: str, real, **kwargs):
    module = load_source(source, unique_name("lt_dp_schedule"))
    model = copy.deepcopy(real)
    return module.bind(model, **kwargs), model


# ---- checks each rank runs -----------------------------------------------------------------------

def check_forward_backward(rank, world, name, source, ragged=False):
    """One forward_backward on this rank's rows: eager's loss and every gradient on the global batch."""
    _, real, _ = pair(name)
    glob = global_batch(name, world, seed=11, ragged=ragged)
    ref_loss, ref_grads = eager_grads(real, glob)
    trainer, model = bind(source, real)
    loss = trainer.forward_backward(rows_of(glob, rank, world))
    assert_grads_match(model, loss, ref_loss, ref_grads)


def check_steps(rank, world, name, source, max_grad_norm, previous=False, ragged=False):
    """STEPS `step`s on this rank's rows of a fresh global batch each (`ragged`: see global_batch): the
    global batch's loss at every step, torch AdamW's weights on the global batches (with
    clip_grad_norm_ first when clipping; `previous`: by the norm of the step before, the first step by
    its own), and the same clipped norm."""
    _, real, _ = pair(name)
    trainer, model = bind(source, real, max_grad_norm=max_grad_norm, **HP)
    ref = copy.deepcopy(real)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    norms = []
    for i in range(STEPS):
        glob = global_batch(name, world, seed=20 + i, ragged=ragged)
        loss = trainer.step(rows_of(glob, rank, world))
        opt.zero_grad()
        ref_loss = _loss(ref(**glob))
        ref_loss.backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf") if previous else max_grad_norm).item()
            used = norms[-1] if previous and norms else norm
            if previous:  # NOTE: [Gradient clipping] in runtime/stepping.py
                for p in ref.parameters():
                    p.grad.mul_(min(1.0, max_grad_norm / (used + 1e-6)))
            assert abs(trainer.last_grad_norm - used) <= 1e-5 * used, f"step {i}: norm {trainer.last_grad_norm} != eager {used}"
            norms.append(norm)
        opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5), f"step {i}: loss {loss} != eager {ref_loss}"
    # the model's own parameters: with sharded host weights only a sync gathers them (NOTE: [Sharded host weights])
    trainer.sync_model()
    if trainer.sharded:
        check_state_shards(trainer, rank, world)
    for (pname, got), want in zip(model.named_parameters(), ref.parameters()):
        err = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"{pname} differs from torch AdamW by {err:.3g}"
    if max_grad_norm is not None:
        assert max(norms) > max_grad_norm, "the clipping threshold never clipped: the test checks nothing"
    return weights_digest(model)


def check_state_shards(trainer, rank, world):
    """With sharded state, each parameter's master and AdamW moments on this rank are its piece:
    ceil(numel / world) elements from rank * that (torch.chunk's cut), so 1/world of the whole."""
    mine = whole = 0
    for p, home in trainer.store.home.items():
        n = trainer.store.master[p].numel()
        c = -(-n // world)
        want = max(0, min(n, (rank + 1) * c) - min(n, rank * c))
        state = trainer.optimizer.state[home]
        assert home.numel() == want and state["exp_avg"].numel() == want and state["exp_avg_sq"].numel() == want, \
            f"{p}: rank {rank} holds {state['exp_avg'].numel()} of its {n} elements' states, not {want}"
        mine, whole = mine + want, whole + n
        if p in trainer.store.held:  # NOTE: [Sharded host weights]: the host keeps the piece of the weights alone
            assert trainer.store.source[p].numel() == want, f"{p}: rank {rank}'s host holds {trainer.store.source[p].numel()}"
    assert mine <= whole / world + len(trainer.store.home), f"rank {rank} steps {mine} of {whole} elements"


def weights_digest(model) -> str:
    """A hash of every parameter's bytes: equal on every rank when the ranks step the same gradients."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_cases(rank, world, cases):
    """Every (check (a function, or its name here), name, source, *args) in turn; {case id: ("ok", its result) or the failure's text}. A failing
    case does not stop the others (they pair their collectives in the same order on every rank)."""
    out = {}
    for case_id, check, *args in cases:
        try:
            out[case_id] = ("ok", (check if callable(check) else globals()[check])(rank, world, *args))
        except AssertionError as exc:
            out[case_id] = f"rank {rank}: {exc}"
        except Exception:
            out[case_id] = f"rank {rank}: {traceback.format_exc()}"
    return out


def launch_cases(cases, world: int = 2, deadline_s: float = 400.0) -> dict[int, dict]:
    """Every case on the same `world` ranks (`run_cases`): {rank: {case id: its outcome}}."""
    results = launch(run_cases, cases, world=world, deadline_s=deadline_s)
    assert sorted(results) == list(range(world))
    return results


def case_results(ranks: dict[int, dict], case) -> list:
    """Every rank's result of `case`; fails with the ranks' failures if any failed."""
    got = [r[case] for r in ranks.values()]
    failures = [r for r in got if not isinstance(r, tuple)]
    assert not failures, "\n".join(failures)
    return [g[1] for g in got]


def check_refused(rank, world, name, source, per_rank_source=None):
    """Binding raises ScheduleMismatch (or DistributedError) on this rank; returns its message."""
    _, real, _ = pair(name)
    if per_rank_source is not None:
        source = per_rank_source[rank]
    try:
        bind(source, real)
    except (ScheduleMismatch, DistributedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("bind accepted it")


def check_other_weights(rank, world, name, source):
    """Ranks whose models start from different weights are refused at bind."""
    _, real, _ = pair(name)
    if rank == 1:
        with torch.no_grad():
            next(real.parameters()).add_(1.0)
    try:
        bind(source, real)
    except DistributedError as exc:
        return str(exc)
    raise AssertionError("bind accepted ranks with different weights")


def lost_rank(rank, world, name, source, mode, timeout_s, release):
    """Rank 1 steps once with rank 0, then exits (`mode` "exit") or stops taking part ("stall");
    rank 0's next step must raise DistributedError, within the group's timeout. Returns rank 0's
    (seconds the failing step took, message)."""
    _, real, _ = pair(name)
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
    trainer, _ = bind(source, real, process_group=group, **HP)
    glob = global_batch(name, world, seed=5)
    trainer.step(rows_of(glob, rank, world))
    if rank == 1:
        if mode == "exit":
            os._exit(0)
        release.wait(timeout=120)  # alive, but in no collective, until rank 0 is done
        return None
    start = time.monotonic()
    try:
        trainer.step(rows_of(glob, rank, world))
    except DistributedError as exc:
        return time.monotonic() - start, str(exc)
    finally:
        release.set()
    raise AssertionError("the step went on without rank 1")


def full_state(trainer, model) -> dict:
    """Every parameter's whole master, moments and step from `sharded_state_dict()`, and the model's weights."""
    sd = trainer.sharded_state_dict()
    out = {}
    for name, entry in sd["state"].items():
        for k, v in entry.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{name}.{k}"] = v.detach().reshape(-1).numpy().copy()  # numpy: no shared memory between processes
    trainer.sync_model()  # with sharded host weights a sync gathers the model's own (NOTE: [Sharded host weights])
    for name, p in model.named_parameters():
        out[f"weight:{name}"] = p.detach().reshape(-1).numpy().copy()
    return out


def check_dcp_save(rank, world, name, source, path):
    """STEPS steps on this rank's rows, then the sharded state saved through torch.distributed.checkpoint;
    returns the whole state, and the weights after one more step (the resumed runs' reference)."""
    import torch.distributed.checkpoint as dcp

    _, real, _ = pair(name)
    trainer, model = bind(source, real, max_grad_norm=0.5, **HP)
    for i in range(STEPS):
        trainer.step(rows_of(global_batch(name, world, seed=40 + i), rank, world))
    sd = trainer.sharded_state_dict()
    if trainer.sharded:  # each rank's optimizer state is its 1/N piece
        for pname, entry in sd["state"].items():
            local, whole = entry["exp_avg"].to_local().numel(), entry["exp_avg"].numel()
            assert local == len(range(whole)[rank * -(-whole // world):(rank + 1) * -(-whole // world)]), pname
    dcp.save(sd, checkpoint_id=path)
    state = full_state(trainer, model)
    trainer.step(rows_of(global_batch(name, world, seed=99), rank, world))
    trainer.sync_model()
    return state, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def check_dcp_load(rank, world, name, source, path, saved_world):
    """A fresh trainer (on `world` ranks) loads the checkpoint; returns its whole state and its weights
    after one more step on the same global batch as the saving run's."""
    import torch.distributed.checkpoint as dcp

    _, real, _ = pair(name)
    trainer, model = bind(source, real, max_grad_norm=0.5, **HP)
    trainer.sync_model()  # the model's weights landed before the load are landed again after it
    sd = trainer.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    trainer.load_sharded_state_dict(sd)
    state = full_state(trainer, model)
    if world != saved_world:  # the schedule is for one rank's rows of another global batch
        return state, None
    trainer.step(rows_of(global_batch(name, saved_world, seed=99), rank, world))
    trainer.sync_model()
    return state, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
