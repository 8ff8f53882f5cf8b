"""Valid inequalities for the step MIP of pass `solve`: rows that tighten its LP relaxation and cut
off no plan, so the search proves its gap sooner while every plan keeps its value.

Needs: the MIP's decision variables (`formulation._vars`) and the linear rows `step_model.StepModel` builds.
Guarantees: each row holds at every integer point that satisfies the model (the arguments are in
the NOTEs); where a precondition of an argument fails, no row is added.
"""

from __future__ import annotations

import mip

# NOTE: [Exposure cuts]
# A window's exposed time is e >= load - cap, load a sum of transfer volumes. In the LP relaxation a
# stage streamed by half puts half its volume in its windows and has them hidden by the whole of
# their compute: the bound of the 72B shape at the full device stayed 3-4% below the plan after 60 s.
# Each stage's stream/gstep/ahead/bstep decisions pick one of five modes (resident; streamed and
# stepped on the host; GPU-stepped, fetched one window ahead; two ahead; stepped in its backward,
# NOTE: [Backward steps]), with 0/1 indicators 1-stream, stream-gstep, gstep-ahead-bstep, ahead and
# bstep (`_vars` nests them: ahead + bstep <= gstep <= stream);
# `off` is its own indicator. Per window and row (H2D, D2H, both), write the load as
# sum_g f_g(mode_g) + q + l0 with q >= 0 (continuous parts) and the capacity as c0 + V (V >= 0:
# recompute), c = c0 - l0 > 0, and add
#     e >= sum over groups g and modes m with f_gm > c of (f_gm - c) * [g in mode m] - V.
# Valid at every integer point, so no plan is cut off and none changes value: if no term is on, the
# right side is -V <= 0 <= e; if k >= 1 are on, it is sum_on f_gm - k*c - V <= load - l0 - c - V
# (every f_g >= 0 in every mode, checked) <= e. In the relaxation it charges a half-streamed stage
# half its exposed time rather than none (root bound of the 72B shape: 10.53 s -> 10.90 s, plan
# 11.18 s), and HiGHS proves 1% in about 25 s on this machine instead of not in 60 s.

def modes(v) -> dict:
    """Each binary a window's transfers read, by index: (its group, its key). A stage's stream,
    gstep, ahead and bstep form one group with five modes (NOTE: [Exposure cuts]); `off` is a group alone."""
    out = {}
    for s in range(len(v["stream"])):
        for key in ("stream", "gstep", "ahead", "bstep"):
            out[v[key][s].idx] = (("stage", s), key)
        out[v["off"][s].idx] = (("off", s), "off")
    return out


def _live(x: mip.LinExpr) -> mip.LinExpr:
    """`x` without its terms in variables bounded to 0 (decisions a stage cannot take, or the search
    leaves out: NOTE: [Disk steps not searched] in formulation.py), which are 0 in every plan."""
    return mip.LinExpr(expr={var: a for var, a in x.expr.items() if not (var.lb == 0 and var.ub == 0)}, const=x.const)


def exposure_cut(m, v, e, load, cap, modes):
    """Adds e >= sum over groups g and their modes m of (load_gm - c)+ * [g in m] - (cap - c), where
    c is `cap`'s constant part; or nothing where the argument of NOTE: [Exposure cuts] fails."""
    load = _live(load if isinstance(load, mip.LinExpr) else mip.LinExpr(const=load))
    cap = _live(cap if isinstance(cap, mip.LinExpr) else mip.LinExpr(const=cap))
    c = cap.const - load.const
    if c <= 0 or any(a < 0 or var.lb < 0 for var, a in cap.expr.items()):
        return
    coef: dict = {}
    for var, a in load.expr.items():
        if var.idx not in modes:
            # an integer count (NOTE: [Boundary tiles] in boundary.py) is as nonnegative as a part
            if var.var_type == mip.BINARY or var.lb < 0 or a < 0:
                return
            continue  # a nonnegative part: leaving it out only weakens the row
        group, key = modes[var.idx]
        coef.setdefault(group, {})[key] = a
    terms = []
    for (kind, s), a in coef.items():
        if kind == "off":
            table = [(a["off"], v["off"][s])]
        else:  # modes host-stepped, GPU-stepped one window ahead, two ahead, in backward; resident adds nothing
            sig, gst, ahd, bst = (a.get(k, 0.0) for k in ("stream", "gstep", "ahead", "bstep"))
            table = [(sig, v["stream"][s] - v["gstep"][s]),
                     (sig + gst, v["gstep"][s] - v["ahead"][s] - v["bstep"][s]),
                     (sig + gst + ahd, v["ahead"][s])]
            if v["bstep"][s].ub > 0.5:  # a stage that may step in backward (its bound is 0 where not)
                table.append((sig + gst + bst, v["bstep"][s]))
        if any(f < 0 for f, _ in table):
            return
        terms += [(f - c) * ind for f, ind in table if f > c]
    if terms:
        m += e >= mip.xsum(terms) - mip.LinExpr(expr=dict(cap.expr))


# NOTE: [Memory cliques]
# A window's memory row is a knapsack: sum_k a_k x_k + const <= B. Where two decisions each need
# more than half of what the window can spare (a GPU-stepped stage's `opt:S` buffer is 10.7 GiB
# for a 72B block; at 24 GiB a window holds one), at most one of them can be on, but the LP
# relaxation puts 0.7 of each in every window: at 72B and 24 GiB its bound was 33% below the plan.
# Per window, let L be the least the row can be (each variable at whichever bound lowers it, links
# between variables ignored, so L is a lower bound; binaries with a_k > 0 sit at 0 there) and K the
# binaries with a_k > (B - L)/2. Then sum_{k in K} x_k <= 1.
# Valid at every integer point: with two members i, j on, the row is at least L + a_i + a_j > B, so
# the point breaks the budget anyway. A plan that fits satisfies the row, and the row names no
# continuous variable, so no plan changes value.
def memory_clique(m, row, cap):
    """Adds sum_{k in K} x_k <= 1 for the binaries K of `row` (bytes <= cap) no two of which fit
    together (NOTE: [Memory cliques])."""
    row = row if isinstance(row, mip.LinExpr) else mip.LinExpr(const=row)
    low = row.const
    for var, a in row.expr.items():
        if a < 0:
            if var.ub == mip.INF or var.ub > 1e20:
                return
            low += a * var.ub
        elif var.lb > 0:
            low += a * var.lb
    spare = cap - low
    if spare <= 0:
        return
    # variables with positive coefficients add nothing to `low` (they sit at 0), so two of them
    # fit together only if a_i + a_j <= spare
    clique = [var for var, a in row.expr.items() if a > spare / 2 and var.var_type == mip.BINARY and var.lb == 0]
    if len(clique) > 1:
        m += mip.xsum(clique) <= 1
