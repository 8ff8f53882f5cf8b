"""Data parallel where the ranks' batches differ in what they learn (NOTE: [Data parallel] in
runtime/data_parallel.py), on 2 CPU ranks in a gloo group spawned from here (dp_worker.py).

  - Tied embeddings in a Hugging Face model (a tiny Qwen2 with tie_word_embeddings): the embedding
    is a shared parameter, so the prologue has no parameter of its own, and its REDUCE and GATHER
    events carry nothing. Sharded and replicated, one `forward_backward` gives eager's loss and
    gradients on the global batch, and three AdamW steps give its losses and weights.
  - Ragged labels (`dp_worker.global_batch(..., ragged=True)`): the first rank learns a token or two
    of its rows (none at every other step), the second every token. The loss of N ranks is the mean
    over every learnt token of the global batch, and so is the gradient, as in one process: the
    loss at every step and the weights after three steps equal eager's on the global batch (fp32,
    1e-5), for a loss stage run whole and one run in chunks (the tiny GPT's forced plan), with
    sharded and with replicated state, and clipped by the global batch's norm. A rank with no
    learnt token contributes nothing, and no NaN.

All cases share one spawn of the ranks (module fixture).
"""

from __future__ import annotations

import pytest

from test_data_parallel import WORLD, _compile, _forced_homes
import dp_worker


@pytest.fixture(scope="module")
def sources():
    return {
        ("qwen2_tied", "sharded"): _compile("qwen2_tied", "resident"),
        ("qwen2_tied", "replicated"): _compile("qwen2_tied", "resident", shard_state=False),
        ("qwen2_tied", "minimum"): _compile("qwen2_tied", "minimum"),
        ("tiny_gpt", "sharded"): _compile("tiny_gpt", "minimum"),
        ("tiny_gpt", "replicated"): _compile("tiny_gpt", "minimum", shard_state=False),
        ("tiny_gpt", "chunked"): _forced_homes(sharded=True),
        ("tiny_gpt", "chunked-replicated"): _forced_homes(sharded=False),
    }


# (model, schedule, check, ragged labels, max_grad_norm)
CASES = [
    ("qwen2_tied", "sharded", "fb", False, None),
    ("qwen2_tied", "sharded", "steps", False, None),
    ("qwen2_tied", "replicated", "steps", False, None),
    ("qwen2_tied", "minimum", "steps", False, None),
    ("qwen2_tied", "sharded", "fb", True, None),
    ("qwen2_tied", "sharded", "steps", True, None),
    ("qwen2_tied", "sharded", "steps", True, 0.5),
    ("qwen2_tied", "replicated", "steps", True, 0.5),
    ("tiny_gpt", "sharded", "steps", True, None),
    ("tiny_gpt", "sharded", "fb", True, None),
    ("tiny_gpt", "replicated", "steps", True, 0.5),
    ("tiny_gpt", "chunked", "steps", True, 0.5),
    ("tiny_gpt", "chunked", "fb", True, None),
    ("tiny_gpt", "chunked-replicated", "steps", True, None),
]
IDS = [f"{m}-{s}-{c}" + ("-ragged" if r else "") + ("-clip" if n else "") for m, s, c, r, n in CASES]


@pytest.fixture(scope="module")
def ranks(sources):
    cases = []
    for case_id, (m, s, check, ragged, clip) in zip(IDS, CASES):
        if check == "fb":
            cases.append((case_id, "check_forward_backward", m, sources[(m, s)], ragged))
        else:
            cases.append((case_id, "check_steps", m, sources[(m, s)], clip, False, ragged))
    results = dp_worker.launch(dp_worker.run_cases, cases, world=WORLD)
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.parametrize("case", IDS)
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, case):
    """fb: the loss and every gradient of one forward_backward; steps: the loss of every step and
    the weights after three, equal single-process eager on the global batch, on both ranks, which
    end with the same weights."""
    got = [r[case] for r in ranks.values()]
    failures = [r for r in got if not isinstance(r, tuple)]
    assert not failures, "\n".join(failures)
    if "-steps" in case:
        assert got[0][1] == got[1][1], "the ranks' weights differ"


def test_ragged_batches_learn_different_numbers_of_tokens():
    """The ragged global batches do what the cases above rely on: the first rank learns a token or
    two (none at odd seeds), the second all of its (shifted) targets."""
    for name in ("qwen2_tied", "tiny_gpt"):
        for seed, first in ((20, (1 + 2)), (21, 0), (11, 0)):
            glob = dp_worker.global_batch(name, WORLD, seed, ragged=True)
            counts = [int((dp_worker.rows_of(glob, r, WORLD)["labels"][:, 1:] != -100).sum()) for r in range(WORLD)]
            rows, seq = dp_worker.rows_of(glob, 1, WORLD)["labels"].shape
            assert counts == [first, rows * (seq - 1)], (name, seed, counts)
