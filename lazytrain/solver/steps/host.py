"""Kind "host": a streamed stage's AdamW on the host worker, beside its master, once its gradient has
landed in host memory; its fp32 moments in host memory, or in the offload file (NOTE:
[Disk-resident states] in solver/disk_model.py). It may start at B(s-2), or after backward with
exact clipping, and ends by the step's end, or before its next prefetch with exact clipping (NOTE:
[Host step deadlines] in runtime/stepping.py)."""

from __future__ import annotations

from lazytrain.ir.events import Kind, Stream
from lazytrain.ir.placement import Tier
from lazytrain.solver.footprint import CPU_STATE_BYTES, HOST_STEP_BYTES, MASTER_BYTES, cpu_step_s, disk_step_s
from lazytrain.solver.shards import piece
from lazytrain.solver.steps.base import StreamedRule, rule


@rule
class Host(StreamedRule):
    kind = "host"

    @staticmethod
    def indicator(v, s):
        return v["stream"][s] - v["gstep"][s] - v["dstep"][s]

    def host_work(self, model, st, x):
        g, hw, M = st.g, model.hw, model.st.master_bytes
        st.host_s = x * cpu_step_s(piece(g.param_bytes, g.param_numel, len(g.params), model.n), st.numel, hw, M)
        disk = model.v["disk"][st.s]
        if model.disk_ok:  # NOTE: [Disk-resident states] in disk_model.py: its moments read and written in the job
            st.host_disk_s = disk * disk_step_s(g.param_numel, hw)
            st.host_s = st.host_s + st.host_disk_s
        else:
            model.m += disk == 0

    def host_bytes(self, model, st, x):
        # NOTE: [State precision per stage] in formulation.py: its moments are fp32 wherever the others' are 8-bit
        return x * (CPU_STATE_BYTES - model.st.state_bytes) * st.g.param_numel

    def host_buffers(self, model):
        st, m, unit = model.st, model.m, model.unit
        if st.master_bytes == MASTER_BYTES:
            return
        # bf16 masters: the host step's reused buffers (NOTE: [Host step buffers] in runtime/optim.py)
        buffers = m.add_var("host_step_buffers", lb=0.0)  # in units of `unit` bytes
        model.floors.append(buffers)
        for s, g in enumerate(st):
            m += buffers >= (HOST_STEP_BYTES * g.largest_numel / unit) * self.indicator(model.v, s)
        model.host = model.host + buffers * unit

    def step_seconds(self, stages, s, p, hw):
        g = stages[s]
        disk = disk_step_s(g.param_numel, hw) if p.step.states is Tier.DISK else 0.0  # NOTE: [Disk-resident states]
        return cpu_step_s(g.param_bytes, g.param_numel, hw, stages.master_bytes) + disk

    def host_step(self, lo, s):
        lo.emit(Stream.CPU, Kind.OPT_STEP, s, reads=(f"host:grad:{s}",), device="cpu")
