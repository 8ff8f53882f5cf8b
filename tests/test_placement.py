"""The placement type: only valid combinations construct, and each writes itself back (repr/eval)."""

import itertools

import pytest

from lazytrain.ir.placement import (
    KINDS,
    NAMESPACE,
    Internals,
    On,
    Outputs,
    Placement,
    PlacementError,
    Step,
    Tier,
    Weights,
    When,
    describe,
)

WEIGHTS = [Weights(streamed, lookahead, cast) for streamed in (False, True) for lookahead in (1, 2) for cast in (False, True)
           if (streamed or lookahead == 1) and not (streamed and cast)]
STEPS = [Step(*key, frees) for key in KINDS for frees in (False, True) if not frees or KINDS[key] == "resident"]


def test_weights_refuse_what_no_runtime_does():
    for args in ((False, 2, False), (True, 1, True), (True, 3, False), (False, 0, False)):
        with pytest.raises(PlacementError):
            Weights(*args)


def test_steps_are_exactly_the_kinds():
    made = set()
    for key in itertools.product(On, When, Tier, Tier):
        if key in KINDS:
            made.add(Step(*key).kind)
        else:
            with pytest.raises(PlacementError, match="the kinds are"):
                Step(*key)
    assert made == {"resident", "host", "prefetch", "job", "backward"}
    with pytest.raises(PlacementError, match="frees its gradients"):
        Step(On.DEVICE, When.PREFETCH, Tier.HOST, Tier.HOST, frees_grads=True)


def test_named_constructors_name_their_kind():
    assert Step.resident().kind == "resident" and Step.resident(True).frees_grads
    assert Step.host().kind == Step.host(Tier.DISK).kind == "host"
    assert Step.at_prefetch().kind == "prefetch" and Step.job().kind == "job"
    assert Step.in_backward(Tier.DISK, Tier.DISK).kind == "backward"


def test_every_combination_constructs_or_is_refused_and_round_trips():
    built = 0
    for w, i, o, s in itertools.product(WEIGHTS, Internals, Outputs, STEPS):
        try:
            p = Placement(w, i, o, s)
        except PlacementError:
            continue
        built += 1
        assert eval(repr(p), dict(NAMESPACE)) == p
        assert p.streamed == (p.kind != "resident")
        assert describe(p)  # every valid placement has its words
    assert built > 50


@pytest.mark.parametrize("args", [
    (Weights(), Internals.SAVED, Outputs.KEEP, Step.host()),  # resident weights, host step
    (Weights(streamed=True), Internals.RECOMPUTED, Outputs.KEEP, Step.resident()),
    (Weights(streamed=True, lookahead=2), Internals.RECOMPUTED, Outputs.KEEP, Step.host()),
    (Weights(streamed=True), Internals.RECOMPUTED, Outputs.DROP, Step.host()),
    (Weights(cast_on_use=True), Internals.SAVED, Outputs.KEEP, Step.resident()),
    (Weights(cast_on_use=True), Internals.RECOMPUTED, Outputs.DROP, Step.resident()),
])
def test_cross_axis_rules_refuse(args):
    with pytest.raises(PlacementError):
        Placement(*args)


def test_words_say_the_step_and_tiers():
    p = Placement(Weights(streamed=True), Internals.RECOMPUTED, Outputs.OFFLOAD, Step.in_backward(Tier.DISK, Tier.DISK))
    text = describe(p, "cuda", "8bit")
    assert "streamed" in text and "outputs offload" in text and "optimizer on gpu" in text
    assert "in its backward" in text and "states on disk" in text and "master on disk" in text and "8bit states" in text
    assert "optimizer on host" in describe(Placement(Weights(streamed=True), Internals.RECOMPUTED, step=Step.host()), "cpu")
