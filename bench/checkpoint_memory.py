"""Host memory while a checkpoint is saved, against the plan's host bytes (NOTE: [Streamed weights
files] in lazytrain/train/tensor_file.py, NOTE: [Mapped regions] in lazytrain/runtime/disk.py).

For a case `bench/fidelity.py compile` wrote (.bench/fidelity/<case>.py): the model built in its
schedule's tiers, bound, stepped, then saved as `lazytrain train` saves (`model.state_dict()` and
`trainer.state_dict()` into `save_checkpoint`), while a thread samples the process's anonymous and
file-backed resident memory (/proc/self/status, every 5 ms). Then the checkpoint is loaded back
(`load_latest`, which checks every file's sha256) and compared with what was saved, tensor by
tensor, to the bit. The row: the plan's host bytes, the anonymous memory before the save and its
peak during it, the file-backed peak (page cache mapped by the process: the kernel may evict it),
the bytes written and the seconds.

    python bench/checkpoint_memory.py --case qwen2.5-7b_b1_s65536_40GiB_8bit_bf16_host36GB_disk --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.bench import _commit  # noqa: E402
from bench.fidelity_cases import CASE_DIR, CASES  # noqa: E402


def _status_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0])
    return out


class Sampler(threading.Thread):
    """The largest RssAnon and RssFile seen while it runs, in bytes."""

    def __init__(self, every_s: float = 0.005):
        super().__init__(daemon=True)
        self.every_s, self.stop, self.peak = every_s, threading.Event(), {"RssAnon": 0, "RssFile": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            for k, v in _status_kib().items():
                if k in self.peak:
                    self.peak[k] = max(self.peak[k], v * 1024)
            time.sleep(self.every_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--root", default=None, help="where the checkpoint goes (default: a temp directory)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    from bench.shapes import batch, for_schedule
    from lazytrain.runtime.disk_masters import DiskMasters, masters_on_disk
    from lazytrain.runtime.schedule import load_schedule
    from lazytrain.train.checkpoint import save_checkpoint
    from lazytrain.train.checkpoint_load import load_latest

    case = next(c for c in CASES if c.name == args.case)
    module = load_schedule(CASE_DIR / f"{case.name}.py")
    masters = DiskMasters(module) if masters_on_disk(module) else None
    model = for_schedule(module, case.model, case.seq, torch.bfloat16 if case.master == "bf16" else torch.float32,
                         masters=masters)
    trainer = module.bind(model, device="cuda", lr=1e-5, disk_masters=masters,
                          max_grad_norm=None if module.CLIPPING == "off" else 1.0)
    data = batch(case.model, case.batch, case.seq, "cuda")
    for _ in range(args.steps):
        trainer.step(data)
    trainer.synchronize()
    on_gpu = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_cuda)
    root = Path(args.root or tempfile.mkdtemp(prefix="lazytrain-ckpt-"))
    before = _status_kib()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    trainer.sync_model()
    model_state = {k: v.detach() for k, v in model.state_dict().items()}
    optimizer_state = trainer.state_dict()
    path = save_checkpoint(root, args.steps, model_state=model_state, optimizer_state=optimizer_state, extra={},
                           fingerprint=module.FINGERPRINT)
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    written = sum(f.stat().st_size for f in path.iterdir())
    found = load_latest(root, module.FINGERPRINT)
    for k, v in model_state.items():
        assert torch.equal(found.model_state[k], v.cpu()), k
    for i, state in optimizer_state["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                assert torch.equal(found.optimizer_state["state"][i][k], v.cpu()), (i, k)
    row = {"case": case.name, "plan_host_bytes": module.PREDICTED.get("host_bytes"), "model_on_gpu_bytes": on_gpu,
           "disk_state_bytes": module.PREDICTED.get("disk_bytes", 0),
           "anon_before_bytes": before["RssAnon"] * 1024, "anon_peak_bytes": sampler.peak["RssAnon"],
           "file_peak_bytes": sampler.peak["RssFile"], "written_bytes": written, "save_s": seconds,
           "verified": True, "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "commit": _commit()}
    print(json.dumps(row, indent=1))
    gib = 2**30
    print(f"| {case.name} | plan host {row['plan_host_bytes'] / gib:.1f} GiB | anon {row['anon_before_bytes'] / gib:.2f} -> "
          f"{row['anon_peak_bytes'] / gib:.2f} GiB | file-backed peak {row['file_peak_bytes'] / gib:.2f} GiB | "
          f"masters on GPU {on_gpu / gib:.1f} GiB | wrote {written / 1e9:.1f} GB in {seconds:.1f} s | verified |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{case.name}.checkpoint.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
