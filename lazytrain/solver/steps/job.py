"""Kind "job": a streamed stage stepped on the device by a job of the host worker that reads its
states from the offload file, steps them in one GPU slot the jobs share and writes them back, once
its gradient has landed and before its next prefetch (NOTE: [Disk-stepped stages] in
solver/disk_model.py, which also counts its disk bytes, its staging buffers and the shared slot)."""

from __future__ import annotations

from lazytrain.ir.events import Kind, Stream
from lazytrain.solver.footprint import disk_gpu_job_s, disk_gpu_state_bytes, disk_io_s, disk_step_slot_bytes
from lazytrain.solver.steps.base import StreamedRule, rule


def _job_s(stages, g, hw) -> float:
    """The job's seconds, mostly the disk's: states read, sent, stepped, brought back and written."""
    return disk_gpu_job_s(g.param_bytes, g.param_numel, len(g.params), hw, stages.state_bytes, stages.master_bytes)


@rule
class Job(StreamedRule):
    kind = "job"

    @staticmethod
    def indicator(v, s):
        return v["dstep"][s]

    def host_work(self, model, st, x):
        g, stages, hw = st.g, model.st, model.hw
        if not model.disk_ok:
            model.m += x == 0
            return
        # due only before its next prefetch (NOTE: [Disk-stepped stages] in disk_model.py)
        st.job_s = x * _job_s(stages, g, hw)
        st.job_disk_s = x * disk_io_s(disk_gpu_state_bytes(g.param_numel, stages.state_bytes), hw)
        model.serial = model.serial + x * (st.step_s * hw.step_lost(g.param_numel))  # beside compute

    def step_seconds(self, stages, s, p, hw):
        return _job_s(stages, stages[s], hw)

    def shared_buffers(self, lo):
        slot = disk_step_slot_bytes(lo.stages, lo.dec)  # the GPU slot the jobs take turns in
        if slot:
            lo.buffer("dstep", "gpu", slot, persistent=True)

    def host_step(self, lo, s):
        lo.emit(Stream.CPU, Kind.OPT_STEP, s, reads=(f"host:grad:{s}",), device="disk")
