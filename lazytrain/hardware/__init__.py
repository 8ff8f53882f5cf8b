"""Hardware profiles: the measured rates the cost model turns FLOPs and bytes into seconds.

Two ship with lazytrain: `h200` (the measured reference GPU machine, the default) and `cpu`.
A profile is a JSON file; `lazytrain compile --hardware hw.json` takes any file with these keys.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from lazytrain.errors import LazytrainError

_HERE = Path(__file__).parent
BUILTIN = {"h200": _HERE / "h200.json", "cpu": _HERE / "cpu.json"}
DEFAULT = "h200"


CUDA_RESERVE = 2 << 30
# NOTE: [Host reserve] Host memory no plan counts: the process itself (Python, torch, the CUDA
# context: resident PyTorch's whole run peaked at 1.5 GiB of host memory on the H200 machine,
# bench/results, 2026-11-29) and the pinned arena's slack (under 80 MiB, NOTE: [Pinned arena] in
# runtime/pinned.py). Plans on a GPU machine keep this much of the host free.
HOST_RESERVE = 2 << 30
# NOTE: [Compiler's host memory] A schedule whose stage bodies run compiled (NOTE: [Fused stages] in
# runtime/fused.py) holds Inductor in its process too: its graphs, generated code, loaded kernels
# and compile state. On the H200 box (2026-12-04) fused runs peaked above their plan's host bytes
# plus HOST_RESERVE by 1.6 GiB (the 7B, fp32 masters, 24 GiB), 1.7 GiB (the same plan that ran
# eager 0.5 GiB under it) and 3.3 GiB (the 32B at 16 x 1024, on the box). A fused plan on a GPU
# keeps this much more of the host free (`Hardware.planning`).
FUSED_HOST_RESERVE = 4 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    device: str
    gpu_memory_bytes: int
    host_memory_bytes: int
    disk_bytes: int
    flops: dict  # dtype name -> peak FLOP/s
    achieved_fraction: float  # share of `flops` and `mem_bandwidth` a stage reaches in a running step (NOTE: [Measured operator rates])
    mem_bandwidth: float
    op_overhead_s: float
    h2d_bandwidth: float
    d2h_bandwidth: float
    duplex_bandwidth: float  # per direction, both directions at once
    pageable_h2d_bandwidth: float
    host_memcpy_bandwidth: float
    cpu_adamw_params_per_s: float
    gpu_adamw_params_per_s: float
    # Recorded, not planned with: it is why host steps keep fp32 states (NOTE: [State precision
    # per stage] in solver/formulation.py).
    cpu_adamw8bit_params_per_s: float
    gpu_adamw8bit_params_per_s: float
    # host stochastic rounding of updated bf16 masters (NOTE: [Host rounding noise] in runtime/optim.py)
    cpu_round_params_per_s: float
    disk_write_bandwidth: float
    disk_read_bandwidth: float
    estimated: tuple = ()
    # NOTE: [Disk reads and writes at once] The offload file's reads and writes together, in bytes a
    # second, while both run: a disk-bound step reads one stage's states (and master) while it writes
    # the last one's back (NOTE: [Disk reads ahead] in runtime/disk_states.py), so a byte read and
    # written back costs 2 / this, not 1 / read + 1 / write. On the 1-GPU H200 box
    # (`bench/disk_engines.py`, 2026-12-01, the tier's 4 threads of 8 MiB chunks) reads and writes
    # at once moved 2.16 GB/s together, where that box's rates one at a time (1.64 read, 2.29 write)
    # give 1.91. The fp32-masters-on-disk 7B fidelity row (2026-12-05, 7649af6) read and wrote 27.25
    # GB a step each in 25.4 s, at least 2.14 GB/s together, on a box whose one-at-a-time rates were
    # the profile's (1.75 and 2.09): priced in series the step was 12 % long. Its plan under the
    # reserve rule on the 1-GPU H100 box (2026-12-06, 953850d) read and wrote 27.73 GB a step each
    # in 25.3 s: 2.19 GB/s together. `lazytrain profile` measures it with the read and write
    # rates. 0: not measured, reads and writes in series.
    disk_duplex_bandwidth: float = 0.0
    # GPU memory the runtime's libraries hold from the caching allocator beside every plan's buffers:
    # cuBLAS keeps a workspace per stream and handle it runs on (0.13-0.19 GiB allocated before a
    # step's first event on the H200, 2026-11-30, `bench/fidelity.py run --trace`)
    runtime_bytes: int = 0
    # NOTE: [Allocator reserve] GPU memory a plan leaves free inside its budget: the caching
    # allocator's budget counts what it reserved, and at the cap it could not give back 0.35-0.47
    # GiB of partly used 2 MiB pages (expandable segments, H200, 2026-11-30); and bf16-master plans
    # allocated up to 1.2 GiB beyond their model by the chunked loss (what each layer's attention
    # saved, counted short until NOTE: [Layouts that decide a copy]). Plans whose buffers filled
    # the budget ran out of memory with 0.4-1.2 GiB still unallocated. A plan whose largest allocation
    # needs more leaves more (NOTE: [Room for the largest block] in solver/reserve.py).
    allocator_reserve_bytes: int = 0
    # share of the matmul rate fused attention reaches (NOTE: [Measured operator rates] in passes/costs.py);
    # with `attention_tokens`, the share it approaches as the keys grow (NOTE: [Attention at length])
    attention_fraction: float = 1.0
    attention_tokens: float = 0.0
    # NOTE: [Matmuls of a tile] A tiled MLP's products (NOTE: [Tiled MLP] in kernels/tiled_mlp.py)
    # have a tile's rows, and a matmul of few rows runs below the profile's rate, which was measured
    # on whole batches: at `tile_rows_half` rows it reaches half, at R rows R / (R + tile_rows_half).
    # On the H200 (`bench/tile_rates.py`, the Qwen2.5-7B MLP at 131,072 tokens, forward and
    # backward, 2026-12-04): 64 MiB tiles (1,771 rows) took 1.202x the time of 4 GiB ones, 256 MiB
    # tiles (7,085 rows) 1.044x, 1 GiB tiles (28,340 rows) 1.000x: 358 and 311 rows, about 330.
    # 0: not measured, every tile at the full rate.
    tile_rows_half: float = 0.0
    # NOTE: [Host steps in a running step] The share of the host optimizer's rates (`cpu_adamw`,
    # `cpu_round`, `host_memcpy`, each measured alone) a host step reaches while the step runs:
    # the copy engines read and write the same host memory, and the main thread issues work beside
    # it. On the H200 machine (`bench/fidelity.py run --events`, 2026-12-04, 789563a) 22 host steps
    # of Qwen2.5-1.5B and 7B layers and lm_heads, fp32 and bf16 masters, took 0.79-1.42x their time
    # at the alone rates, median 1.04 (fp32-master 7B layers 0.91-1.12, bf16-master 1.5B layers
    # 1.13-1.42): 0.96. It was 0.75, from 1.5B traces of 2026-11-30, before host steps reused their
    # buffers (NOTE: [Host step buffers] in runtime/optim.py); with it the 7B's fp32 host steps were
    # priced 155 ms and took 105-129. Fewer torch threads make them slower (8 threads: 1.5x).
    # Those steps waited for the GIL after each torch call (NOTE: [Host steps and the GIL] in
    # runtime/streams.py); with that mended (c741a4d), three re-run rows' host steps took 1.03-1.19x
    # their price at 0.96 (2026-12-04): too few to fit it again.
    host_fraction: float = 1.0
    # NOTE: [Link bandwidth] The data-parallel ranks' link, as NCCL's "algorithm bandwidth": a
    # reduce-scatter or all-gather of a B-byte buffer (the whole stage's gradients or weights) takes
    # B / link_bandwidth seconds. `lazytrain profile` measures it under torchrun on 2+ GPUs; 0: not
    # known, and a plan for several ranks with sharded state is refused until it is.
    link_bandwidth: float = 0.0
    # NOTE: [Device steps of bf16 masters] A bf16 master steps on the device through an fp32 twin of
    # each tensor, rounded back stochastically (NOTE: [bf16 master weights] in runtime/optim.py): per
    # parameter on top of the fp32-master rate, and per tensor (a generator and its launches). On
    # the H200 (`bench/gpu_step.py`, 2026-11-30) a Qwen2.5-1.5B layer's 8-bit step took 3.31 ms with
    # bf16 masters against 1.43 ms with fp32 ones; fitted over 1.5B-14B layers, whole and cut into
    # 3x the tensors: 7.7e10 params/s and 0.14 ms a tensor. 0: not counted.
    gpu_round_params_per_s: float = 0.0
    gpu_round_tensor_s: float = 0.0
    # NOTE: [Steps the host issues after backward] With exact clipping each device step waits for
    # the global norm (NOTE: [Gradient clipping] in runtime/stepping.py), so after backward the
    # device has nothing queued but the steps, and it runs each as fast as the host issues it: a
    # tensor's twin, rounding generator, 8-bit step and copy back are a dozen launches and their
    # Python. Such a step takes the longer of the device's time and `gpu_step_issue_tensor_s` a
    # tensor (`footprint.deferred_step_s`). On the H200 (`bench/step_issue.py`, 2026-12-05, 0248bf9:
    # the 1.5B at 24 GiB, exactly clipped, fused, 6 timed steps at two GIL switch intervals;
    # bench/results/fused/2026-12-05/step_issue.log) a Qwen2.5-1.5B layer's step of 12 tensors took
    # the host 3.8-6.0 ms to issue, median 5.63, against the 3.54 ms the device takes: 0.47 ms a
    # tensor; the device was done 0-3 ms after the last was issued. A 7B layer's (10.9 ms on the
    # device) stays the device's. 0: not counted.
    gpu_step_issue_tensor_s: float = 0.0
    # NOTE: [Device steps beside compute] Device optimizer steps run on a stream of their own (NOTE:
    # [Optimizer stream] in runtime/stepping.py) beside backward's compute. Memory-bound, they take
    # SMs and memory bandwidth from it: compute runs `gpu_step_lost` times the step's alone time
    # longer, while the step advances at `gpu_step_pace` of its alone speed. On the H200
    # (`bench/step_overlap.py`, a Qwen2.5-1.5B layer's forward and backward at 16 x 1024 beside its
    # 8-bit bf16-master step, 2026-12-01) compute lost 0.34-0.37 of the step; the fidelity trace of
    # the 1.5B at 40 GiB showed backward windows of 9.4 ms against 8.1 beside 3.5 ms steps (0.37),
    # each step done in the 8.7-11 ms after its release (a pace of 0.3-0.4). Without a measurement
    # (1.0, 0.0) every step runs alone after backward, in series with compute.
    # Larger steps lose more: fidelity traces of fused plans on the H200 (8a9c84f, 2026-12-04) ran as
    # if a Qwen2.5-7B block's 8-bit bf16-master step beside backward cost compute 0.9 of its alone
    # time (the 7B at the whole device: 2.824 s measured; 2.676 priced at 0.37, 2.855 in series) and
    # a 14B block's 0.76 (at the whole device) to over 1 (at 40 GiB); `bench/step_overlap.py` had
    # measured 0.45-0.79 for a 7B layer. So `gpu_step_lost` holds at blocks of `gpu_step_lost_numel`
    # parameters and `gpu_step_lost_large` at `gpu_step_lost_large_numel`, linear in the log of the
    # size between, and flat outside (`step_lost`); 0: `gpu_step_lost` at every size.
    gpu_step_lost: float = 1.0
    gpu_step_pace: float = 0.0
    gpu_step_lost_numel: int = 0
    gpu_step_lost_large: float = 0.0
    gpu_step_lost_large_numel: int = 0
    # The time of a fused stage's element-wise work over its eager time, where the runtime compiles
    # stage bodies with Inductor (NOTE: [Fused stage prices] in passes/fusion.py); 1.0: not known,
    # fused stages are priced eager.
    fused_elementwise_factor: float = 1.0

    @property
    def max_budget(self) -> int:
        """The most a plan may use (`--budget max`): the device's memory less what the CUDA context,
        library workspaces and the allocator's rounding keep outside any plan."""
        return self.gpu_memory_bytes - (CUDA_RESERVE if self.device == "cuda" else 0)

    def check_budget(self, budget: int) -> None:
        """Refuse a `--budget` larger than `max_budget`: no device of this profile has it, and a plan
        within it would be an OOM on the device."""
        if budget > self.max_budget:
            from lazytrain.units import format_size

            whole = " (its memory less 2 GiB for the CUDA context and libraries)" if self.device == "cuda" else ""
            raise LazytrainError(f"--budget {format_size(budget)} is more than a plan can have on hardware profile "
                                 f"'{self.name}': {format_size(self.max_budget)}{whole}; pass a smaller --budget, or max")

    def planning(self, fused: bool) -> "Hardware":
        """The machine a plan is made for: with `fused` stage bodies on a GPU, its host less
        Inductor's share (NOTE: [Compiler's host memory])."""
        if not fused or self.device != "cuda":
            return self
        return replace(self, host_memory_bytes=max(HOST_RESERVE, self.host_memory_bytes - FUSED_HOST_RESERVE))

    @property
    def host_capacity(self) -> int:
        """The host memory a plan may use: all of it less the process's own (NOTE: [Host reserve])."""
        return self.host_memory_bytes - (HOST_RESERVE if self.device == "cuda" else 0)

    def attention_share(self, keys: int) -> float:
        """The share of the matmul rate fused attention over `keys` keys reaches (NOTE: [Attention at
        length] in passes/costs.py)."""
        if self.attention_tokens <= 0:
            return self.attention_fraction
        return self.attention_fraction * keys / (keys + self.attention_tokens)

    def tile_share(self, rows: int) -> float:
        """The share of the matmul rate a product over `rows` rows of a tile reaches (NOTE:
        [Matmuls of a tile])."""
        return rows / (rows + self.tile_rows_half) if rows > 0 else 1.0

    def flops_for(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["float32"]) * self.achieved_fraction

    def step_lost(self, numel: int) -> float:
        """The share of a device step's alone time that compute loses beside it, for a block of
        `numel` parameters (NOTE: [Device steps beside compute])."""
        small, large = self.gpu_step_lost_numel, self.gpu_step_lost_large_numel
        if not self.gpu_step_lost_large or not 0 < small < large:
            return self.gpu_step_lost
        f = (math.log(max(numel, 1)) - math.log(small)) / (math.log(large) - math.log(small))
        return self.gpu_step_lost + min(max(f, 0.0), 1.0) * (self.gpu_step_lost_large - self.gpu_step_lost)

    @property
    def bytes_per_s(self) -> float:
        """The device memory bandwidth an elementwise operator reaches in a running step."""
        return self.mem_bandwidth * self.achieved_fraction

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=1, default=list)


def load(name_or_path: str | Path | None = None) -> Hardware:
    """A built-in profile by name ("h200", "cpu"), or a JSON file; None gives the default."""
    key = str(name_or_path) if name_or_path is not None else DEFAULT
    path = BUILTIN.get(key, Path(key))
    if not path.is_file():
        raise LazytrainError(
            f"hardware profile {key!r} not found; use one of {sorted(BUILTIN)} or a JSON file from `lazytrain profile`"
        )
    fix = "regenerate it with `lazytrain profile -o hw.json`, or pass h200 or cpu"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LazytrainError(f"hardware profile {path} cannot be read as JSON ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); {fix}") from None
    if not isinstance(data, dict):
        raise LazytrainError(f"hardware profile {path} holds a JSON {type(data).__name__}, not an object; {fix}")
    known = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware) if f.default is MISSING and f.default_factory is MISSING}
    missing = required - set(data)
    if missing:
        raise LazytrainError(f"hardware profile {path} lacks {sorted(missing)}; regenerate it with `lazytrain profile`")
    data["estimated"] = tuple(data.get("estimated", ()))
    data = {k: v for k, v in data.items() if k in known}
    _check_values(path, data, fix)
    return Hardware(**data)


# Rates and sizes the cost model divides by or plans within: a profile must give them above zero.
# The rest are counts, shares and measured extras, where zero means "none" or "not measured".
_POSITIVE = {"gpu_memory_bytes", "host_memory_bytes", "achieved_fraction", "mem_bandwidth", "h2d_bandwidth",
             "d2h_bandwidth", "duplex_bandwidth", "pageable_h2d_bandwidth", "host_memcpy_bandwidth",
             "cpu_adamw_params_per_s", "gpu_adamw_params_per_s", "attention_fraction", "host_fraction",
             "fused_elementwise_factor"}
# of a measured alone rate (or time): at most 1
_SHARES = {"achieved_fraction", "attention_fraction", "host_fraction", "fused_elementwise_factor"}


def _check_values(path: Path, data: dict, fix: str) -> None:
    """Every number finite and of its sign, the device a known one: a negative bandwidth would plan
    transfers that take negative time."""
    if data["device"] not in ("cpu", "cuda"):
        raise LazytrainError(f"hardware profile {path}: device {data['device']!r} is not 'cpu' or 'cuda'; {fix}")
    if not isinstance(data["flops"], dict) or "float32" not in data["flops"]:
        raise LazytrainError(f"hardware profile {path}: flops must map dtype names (float32 among them) to FLOP/s; {fix}")
    numbers = {f"flops.{k}": v for k, v in data["flops"].items()}
    numbers.update({f.name: data[f.name] for f in fields(Hardware) if f.name in data and f.type in ("int", "float")})
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LazytrainError(f"hardware profile {path}: {name} is {value!r}, not a finite number; {fix}")
        low = 0 if name.startswith("flops.") or name in _POSITIVE else None
        if value < 0 or (low is not None and value <= low):
            raise LazytrainError(f"hardware profile {path}: {name} is {value!r}; it must be "
                                 f"{'above' if low is not None else 'at least'} zero; {fix}")
        if name in _SHARES and value > 1:
            raise LazytrainError(f"hardware profile {path}: {name} is {value!r}, a share of a measured rate: at most 1; {fix}")
