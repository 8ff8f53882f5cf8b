"""The configurations `bench/fidelity.py` compiles and runs, and where their schedules and rows live."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASE_DIR = ROOT / ".bench" / "fidelity"
RESULTS = HERE / "results" / "fidelity"
GiB = 2**30


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    seq: int
    states: str  # "32bit" or "8bit"
    master: str  # "fp32" or "bf16"
    budget: str  # "24GiB", "40GiB", "max" or "min" (the smallest feasible)
    clipping: str = "off"  # the run clips at norm 1.0 unless "off" (NOTE: [Gradient clipping] in runtime/stepping.py)
    host: str = ""  # compiled for the profile with this much host memory, with the disk tier (`--disk`)
    tile: str = ""  # --tile-bytes: gated MLPs and RMSNorms in tiles of tokens (NOTE: [Tiled MLP], [Tiled RMSNorm])

    @property
    def name(self) -> str:
        clip = "" if self.clipping == "off" else f"_clip-{self.clipping}"
        host = f"_host{self.host}_disk" if self.host else ""
        tile = f"_tile{self.tile}" if self.tile else ""
        return f"{self.model}_b{self.batch}_s{self.seq}_{self.budget}_{self.states}_{self.master}{clip}{host}{tile}"


def _cases() -> list[Case]:
    out = []
    for model, batch in (("qwen2.5-1.5b", 16), ("qwen2.5-7b", 32), ("qwen2.5-14b", 8)):
        for states, master in (("32bit", "fp32"), ("8bit", "bf16"), ("8bit", "fp32"), ("32bit", "bf16")):
            for budget in ("24GiB", "40GiB", "max"):
                out.append(Case(model, batch, 1024, states, master, budget))
    out += [Case("qwen2.5-7b", 1, 65536, "8bit", "bf16", "min"), Case("qwen2.5-7b", 1, 65536, "8bit", "bf16", "max")]
    for model, batch in (("qwen2.5-1.5b", 16), ("qwen2.5-7b", 32)):  # clipped runs: host steps after backward
        out += [Case(model, batch, 1024, "8bit", "bf16", "24GiB", clip) for clip in ("exact", "previous-norm")]
    # the disk tier where host memory binds (NOTE: [Disk-stepped stages] in solver/disk_model.py)
    out += [Case("qwen2.5-7b", 32, 1024, "8bit", "bf16", "24GiB", host="44GB"),
            Case("qwen2.5-32b", 16, 1024, "8bit", "bf16", "max", host="104GB")]
    # stage outputs on disk (NOTE: [Activations on disk] in solver/disk_model.py): long rows on a small
    # host, beside the same budget with the whole host, where they go to host memory
    out += [Case("qwen2.5-7b", 1, 65536, "8bit", "bf16", "40GiB", host=host) for host in ("128GB", "36GB")]
    # issue targets on the whole box (128 GB host, its 64 GB disk): fp32 masters of the 32B, the 72B
    # fp32 masters on disk (NOTE: [Masters on disk] in solver/disk_model.py): a host too small for the
    # 7B's fp32 masters at 24 GiB, beside the same budget with the whole host
    out += [Case("qwen2.5-7b", 32, 1024, "8bit", "fp32", "24GiB", host=host) for host in ("128GB", "40GB")]
    out += [Case("qwen2.5-32b", 32, 1024, "8bit", "fp32", "max", host="128GB"),
            Case("qwen2.5-72b", 8, 1024, "8bit", "bf16", "max", host="128GB"),
            Case("qwen2.5-72b", 16, 1024, "8bit", "bf16", "max", host="128GB"),
            Case("qwen2.5-72b", 32, 1024, "8bit", "bf16", "max", host="128GB")]
    # long rows with tiled MLPs (issue targets: 131,072 inside 24 GiB; 262,144's TFLOPS; 524,288 trains)
    out += [Case("qwen2.5-7b", 1, 131072, "8bit", "bf16", "24GiB", tile="256MiB"),
            Case("qwen2.5-7b", 1, 262144, "8bit", "bf16", "64GiB", tile="256MiB"),
            Case("qwen2.5-7b", 1, 262144, "8bit", "bf16", "max", tile="256MiB"),
            Case("qwen2.5-7b", 1, 524288, "8bit", "bf16", "max", host="128GB", tile="256MiB")]
    return out


CASES = _cases()


def _selected(only: str | None) -> list[Case]:
    return [c for c in CASES if only is None or any(fnmatch.fnmatch(c.name, g) for g in only.split(","))]
