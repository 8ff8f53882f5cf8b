"""The `lazytrain` command: compile, inspect, train, profile.

Errors from lazytrain's hierarchy, a bad flag, and a full disk print as one line
(`lazytrain: error: ...`) and exit with 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from lazytrain import cli_flags as flags
from lazytrain.errors import LazytrainError
from lazytrain.units import format_size


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as lazytrain's own errors print (argparse adds the usage text)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")

    def parse_args(self, args=None, namespace=None):
        """Unknown flags are reported by the command they were given to, whose --help lists its flags."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = self._commands.get(getattr(parsed, "command", None), self) if hasattr(self, "_commands") else self
            command.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


_TILES = ("compute each gated MLP and RMSNorm (Qwen2, Llama, Gemma3) in tiles of tokens whose widest intermediate "
          "takes at most this (e.g. 256MiB), keeping only its input for backward, which recomputes each tile: for "
          "long sequences. 'auto' (default): in tiles where no untiled plan fits the budget, or where that lowers "
          "--budget min, of the size (64MiB, 256MiB or 1GiB) whose plan is fastest; 0 or 'off': never tile")


def compile_options(args):
    """The CompileOptions of `lazytrain compile`'s flags."""
    import torch

    from lazytrain.options import FUSE_STAGES, CompileOptions
    from lazytrain.passes.chunk import LOSS_CHUNK_BYTES

    return CompileOptions(budget=args.budget, time_limit=args.time_limit,
                          dtype=getattr(torch, args.dtype) if args.dtype else None,
                          optimizer_states=args.optimizer_states, master_weights=args.master_weights,
                          loss_chunk_bytes=LOSS_CHUNK_BYTES if args.loss_chunk_bytes is None else args.loss_chunk_bytes,
                          tile_bytes=args.tile_bytes, world_size=args.world_size, shard_state=False if args.replicate_state else None,
                          shard_weights=False if args.whole_host_weights else None,
                          clipping=args.clipping, disk=args.disk, fuse_stages=FUSE_STAGES[args.fuse_stages])


def train_options(args):
    """The CompileOptions of `lazytrain train`'s flags, for compiling on the fly: the master weights
    (when not given: the model's dtype's), the ranks and their sharding are the run's to fill in
    (`train/loop.py`)."""
    from lazytrain.options import FUSE_STAGES, CompileOptions

    clipping = args.clipping if args.max_grad_norm is not None else "off"  # NOTE: [Gradient clipping] in runtime/stepping.py
    return CompileOptions(budget=args.budget, time_limit=args.time_limit, optimizer_states=args.optimizer_states or "32bit",
                          master_weights=args.master_weights or "fp32", clipping=clipping, disk=args.disk,
                          tile_bytes=args.tile_bytes, fuse_stages=FUSE_STAGES[args.fuse_stages])


def cmd_compile(args) -> int:
    from lazytrain.compile_file import compile_file
    from lazytrain.progress import reporting

    with reporting():  # NOTE: [Compile progress] in progress.py
        compiled = compile_file(args.model, args.output, compile_options(args), hardware=args.hardware,
                                dump_dir=args.dump_ir, time_passes=args.time_passes)
    from lazytrain.runtime.schedule import load_schedule
    from lazytrain.solver.reserve import LARGEST_MARGIN
    from lazytrain.summary import summary

    print(summary(load_schedule(args.output)), end="")
    if compiled.options.tile_bytes:
        chose = (" (--tile-bytes auto: no untiled plan fits, or a tiled one fits less; of 64MiB, 256MiB and 1GiB the "
                  "size whose plan is fastest, or smallest for --budget min)") if args.tile_bytes is None else ""
        print(f"gated MLPs and RMSNorms run in tiles of {format_size(compiled.options.tile_bytes)}{chose}")
    if compiled.schedule.reserve > compiled.hardware.allocator_reserve_bytes:  # NOTE: [Room for the largest block]
        print(f"the plan leaves the GPU's caching allocator {format_size(compiled.schedule.reserve)} of the budget, more "
              f"than the profile's {format_size(compiled.hardware.allocator_reserve_bytes)}: room for the step's largest "
              f"allocation ({format_size(compiled.schedule.reserve - LARGEST_MARGIN)}) and {format_size(LARGEST_MARGIN)}")
    print(f"solved in {compiled.plan.solver.seconds:.2f} s; wrote {args.output} ({len(compiled.schedule.events)} events, verified peak "
          f"{format_size(max(compiled.memory_trace))} <= budget {format_size(compiled.plan.budget, round_up=True)})")
    return 0


def cmd_inspect(args) -> int:
    from lazytrain.runtime.schedule import load_schedule
    from lazytrain.summary import summary

    module = load_schedule(args.schedule)
    print(summary(module), end="")
    if args.trace or args.png:
        from lazytrain import timeline

        measured = timeline.load_measured(args.measured, module) if args.measured else None
        if args.trace:
            timeline.write_trace(module, args.trace, measured)
            print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
        if args.png:
            timeline.plot_png(module, args.png, measured)
            print(f"wrote {args.png}")
    return 0


def cmd_train(args) -> int:
    from lazytrain.train import distributed

    if args.nproc_per_node is not None and args.nproc_per_node > 1 and not distributed.launched():
        distributed.relaunch(args.nproc_per_node, args.argv)  # NOTE: [Launching]: each rank comes back here
        return 0
    from lazytrain.train.loop import train

    train(args, train_options(args))
    return 0


def cmd_profile(args) -> int:
    from lazytrain.profile import profile

    hw = profile(args.output, quick=args.quick, offload_dir=args.offload_dir)
    print(f"wrote {args.output}: {hw.description}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lazytrain", description="Compile and run training steps under a GPU memory budget.")
    sub = p.add_subparsers(dest="command", required=True)
    p._commands = sub.choices  # command name -> its parser (`_Parser.parse_args`)

    c = sub.add_parser("compile", help="compile model.py into a static schedule.py")
    c.add_argument("model", help="a .py file defining build_model() and example_batch()")
    c.add_argument("-o", "--output", type=flags.nonempty_path, required=True, help="the schedule module to write")
    c.add_argument("--budget", type=flags.budget, default="max",
                   help="GPU memory budget, e.g. 24GiB; 'min' for the smallest feasible, 'max' (default) for the whole device")
    c.add_argument("--hardware", default=None, help="hardware profile: h200 (default), cpu, or a JSON file from `lazytrain profile`")
    c.add_argument("--dump-ir", type=flags.nonempty_path, metavar="DIR", default=None, help="write the IR after every stage into DIR")
    c.add_argument("--time-limit", type=flags.number(0), default=60.0, metavar="SECONDS", help="solver time limit (default 60)")
    c.add_argument("--time-passes", action="store_true", help="print each stage's time to stderr")
    c.add_argument("--optimizer-states", choices=["32bit", "8bit"], default="32bit",
                   help="AdamW state precision: 32bit (torch AdamW) or 8bit (bitsandbytes, blockwise quantised; "
                        "blocks stepped on the host CPU keep 32-bit states)")
    c.add_argument("--master-weights", choices=["fp32", "bf16"], default="fp32",
                   help="precision of the weights the optimizer updates: fp32 (default), or bf16 with stochastic "
                        "rounding (half the host memory and traffic; the model's parameters become bf16)")
    c.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: the model's); master weights stay fp32 unless --master-weights bf16")
    c.add_argument("--loss-chunk-bytes", type=flags.chunk_bytes, default=None, metavar="SIZE",
                   help="run the loss stage (final norm, lm_head, cross-entropy) in chunks of rows or tokens, each at most "
                        "this working set (default 1GiB); 0 or 'off' never chunks")
    c.add_argument("--tile-bytes", type=flags.tile_bytes, default=None, metavar="SIZE", help=_TILES)
    c.add_argument("--world-size", type=flags.at_least(1), default=1, metavar="N",
                   help="data-parallel ranks the schedule runs on (default 1); example_batch() is one rank's batch, "
                        "and every rank binds the same schedule (see README, Data parallel)")
    c.add_argument("--replicate-state", action="store_true",
                   help="with --world-size > 1: every rank keeps the whole optimizer state and master weights (default: "
                        "each keeps 1/N of them, sharded)")
    c.add_argument("--whole-host-weights", action="store_true",
                   help="with sharded state: every rank's host keeps the whole compute-dtype weights of the streamed "
                        "blocks (default: each keeps 1/N of them, all-gathered over the GPU link at every prefetch)")
    c.add_argument("--clipping", choices=["exact", "previous-norm", "off"], default="exact",
                   help="the gradient clipping planned for (bind's max_grad_norm): exact (default; optimizer steps on "
                        "the host wait for the end of backward), previous-norm (clip by the previous step's norm; "
                        "steps run during backward), or off (no clipping)")
    c.add_argument("--disk", action="store_true",
                   help="let the plan keep optimizer states, and stage outputs between forward and backward, on disk "
                        "where host memory runs short (the profile's disk_bytes and disk rates; bind's offload_dir "
                        "holds them)")
    c.add_argument("--fuse-stages", choices=["auto", "on", "off"], default="auto",
                   help="plan for stage bodies compiled by Inductor, their element-wise work priced at the profile's "
                        "fused_elementwise_factor (the schedule's FUSED, which `lazytrain train` follows on a GPU): "
                        "auto (default) for a CUDA hardware profile, off for the CPU's")
    c.set_defaults(fn=cmd_compile)

    i = sub.add_parser("inspect", help="summarise a compiled schedule")
    i.add_argument("schedule")
    i.add_argument("--trace", metavar="JSON", help="write the step's timeline as Chrome-trace/Perfetto JSON")
    i.add_argument("--png", metavar="PNG", help="plot the timeline and predicted memory as a PNG")
    i.add_argument("--measured", metavar="JSON", help="a measured timeline (RUN_DIR/measured.json from `lazytrain train`) to show beside the predicted one")
    i.set_defaults(fn=cmd_inspect)

    t = sub.add_parser("train", help="train a model with a schedule (default: the built-in tiny model on the shipped corpus)")
    t.add_argument("--model", type=flags.nonempty_path, default=None, help="model file, or Hugging Face model directory: config.json, safetensors "
                                                "(one file or shards with their index), tokenizer (default: the bundled tiny Qwen2-style model)")
    t.add_argument("--weights", default=None, help="a .safetensors file or model.safetensors.index.json to start from "
                                                  "(default: the model directory's); 'random' for a fresh initialisation")
    t.add_argument("--data", nargs="+", default=None, help=".txt/.jsonl files or directories (default: the shipped corpus)")
    t.add_argument("--tokenizer", default=None, help="local Hugging Face tokenizer (default: the model directory's, else the shipped one)")
    t.add_argument("--packing", choices=["on", "off"], default="on",
                   help="on (default): pack whole examples (chat, prompt/completion, ids with labels) several to a row, "
                        "best fit decreasing, kept apart by position_ids; off: one padded row per example")
    t.add_argument("--cross-document-attention", action="store_true",
                   help="let the text documents concatenated into a row attend to each other (default: each attends "
                        "to itself alone)")
    t.add_argument("--eval-data", nargs="+", default=None, metavar="FILES",
                   help="held-out data (the --data formats): its loss over learnt tokens is printed and logged as "
                        "eval_loss after the last step and every --eval-every steps")
    t.add_argument("--eval-every", type=flags.at_least(1), default=None, metavar="N",
                   help="with --eval-data: evaluate every N steps too (default: after the last step only)")
    t.add_argument("--eval-steps", type=flags.at_least(1), default=None, metavar="K",
                   help="with --eval-data: batches an evaluation reads from the eval set's start (default: the whole "
                        "set, at most 50)")
    t.add_argument("--batch-size", type=flags.at_least(1), default=None, help="for model directories (model files set their own)")
    t.add_argument("--seq-len", type=flags.at_least(1), default=None, help="for model directories (model files set their own)")
    t.add_argument("--schedule", type=flags.nonempty_path, default=None, help="a compiled schedule (default: compile on the fly)")
    t.add_argument("--budget", type=flags.budget, default="min", help="GPU budget when compiling on the fly: a size, min (default) or max")
    t.add_argument("--hardware", default=None, help="hardware profile for compiling (default: cpu without a GPU, else h200)")
    t.add_argument("--time-limit", type=flags.number(0), default=60.0, help="solver time limit in seconds")
    t.add_argument("--optimizer-states", choices=["32bit", "8bit"], default=None,
                   help="AdamW state precision when compiling on the fly (default 32bit; a given --schedule has its own)")
    t.add_argument("--master-weights", choices=["fp32", "bf16"], default=None,
                   help="master weight precision when compiling on the fly (default: bf16 for a model whose config "
                        "says bfloat16, else fp32; bf16 rounds stochastically); a given --schedule has its own")
    t.add_argument("--max-grad-norm", type=flags.number(0), default=None, help="clip gradients to this global norm (default off)")
    t.add_argument("--clipping", choices=["exact", "previous-norm"], default=None,
                   help="with --max-grad-norm: clip by this step's global norm (exact, default) or the previous step's "
                        "(previous-norm: faster where optimizer steps run on the host); a given --schedule has its own")
    t.add_argument("--tile-bytes", type=flags.tile_bytes, default=None, metavar="SIZE",
                   help=_TILES + "; when compiling on the fly")
    t.add_argument("--fuse-stages", choices=["auto", "on", "off"], default="auto",
                   help="run each block kind's stage body compiled by torch.compile (Inductor), fusing its "
                        "element-wise work: auto (default) as the schedule was planned (its FUSED) on a GPU, off on "
                        "the CPU; on or off also plans so when compiling on the fly; the first steps compile, and "
                        "that time is printed and not counted in their tok/s")
    t.add_argument("--disk", action="store_true",
                   help="when compiling on the fly: let the plan keep optimizer states, and stage outputs between "
                        "forward and backward, on disk where host memory runs short")
    t.add_argument("--offload-dir", type=flags.nonempty_path, default=None,
                   help="an existing directory for what a schedule keeps on disk (default: the run "
                        "directory's offload/); the file is preallocated before training and removed at the end")
    t.add_argument("--steps", type=flags.at_least(1, flags.MAX_STEPS), default=None,
                   help="steps the run ends at (default 200; on --resume, the run's own)")
    t.add_argument("--lr", type=flags.number(0, 1), default=None,
                   help="peak learning rate, at most 1 (default 3e-3; on --resume, the run's own)")
    t.add_argument("--warmup-steps", type=flags.at_least(0, flags.MAX_STEPS), default=None,
                   help="linear warm-up steps (default: 10%% of --steps; on --resume, the run's own)")
    t.add_argument("--min-lr-ratio", type=flags.number(0, 1, low_open=False), default=None,
                   help="cosine decay ends at this fraction of --lr (default 0.1; on --resume, the run's own)")
    t.add_argument("--new-lr-schedule", action="store_true",
                   help="with --resume: follow the LR schedule these flags give from the checkpoint's step on, "
                        "instead of the one the run was started with")
    t.add_argument("--weight-decay", type=flags.number(0, 10, low_open=False), default=0.01,
                   help="AdamW's decoupled weight decay, at most 10 (default 0.01)")
    t.add_argument("--seed", type=flags.at_least(0, flags.MAX_SEED), default=0,
                   help="seed of the starting weights (with --weights random), the data order and dropout (default 0)")
    t.add_argument("--no-shuffle", action="store_true",
                   help="read the data in file order every epoch (default: each epoch shuffled from --seed; a resumed "
                        "run keeps the order it started with)")
    t.add_argument("--checkpoint-dir", type=flags.nonempty_path, default=None, help="run directory: schedule.py, log.jsonl, checkpoints/")
    t.add_argument("--checkpoint-every", type=flags.at_least(1), default=50,
                   help="save a checkpoint every N steps, and after the last (default 50; needs --checkpoint-dir)")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --checkpoint-dir")
    t.add_argument("--log", type=flags.nonempty_path, default=None,
                   help="JSONL log, one record per step (default: CHECKPOINT_DIR/log.jsonl); rewritten from the run's start")
    t.add_argument("--overwrite-log", action="store_true",
                   help="let a new run (no --resume) replace an existing --log file other than its run directory's "
                        "log.jsonl (refused by default)")
    t.add_argument("--export-hf", type=flags.nonempty_path, default=None, metavar="DIR",
                   help="after training, save a Hugging Face model directory (weights and the training tokenizer)")
    t.add_argument("--overwrite-export", action="store_true",
                   help="let --export-hf replace the --model directory, or a directory that holds other files than "
                        "an earlier export, whole (refused by default)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar; print one line per step")
    t.add_argument("--print-every", type=flags.at_least(1), default=10, help="print a loss line every N steps (default 10)")
    t.add_argument("--nproc-per-node", type=flags.at_least(1), default=None, metavar="N",
                   help="train data parallel on N ranks of this host (GPUs, or CPU processes), started through torch's "
                        "launcher; the batch is the global batch, split over the ranks (or launch with `torchrun "
                        "--nproc-per-node N -m lazytrain train ...`; see README, Training on several ranks)")
    t.add_argument("--dist-timeout", type=flags.number(0), default=600.0, metavar="SECONDS",
                   help="on several ranks: how long a rank waits for the others in any collective, rank 0's compile "
                        "included, before it fails (default 600)")
    t.set_defaults(fn=cmd_train)

    pr = sub.add_parser("profile", help="measure this machine into a hardware profile")
    pr.add_argument("-o", "--output", required=True)
    pr.add_argument("--quick", action="store_true", help="smaller measurements (seconds instead of a minute)")
    pr.add_argument("--offload-dir", default=None, metavar="DIR",
                    help="directory on the disk the offload tier will use: its read and write rates and free space "
                         "are measured there (default: the system temp directory)")
    pr.set_defaults(fn=cmd_profile)
    return p


def main(argv: list[str] | None = None) -> int:
    # Weight and optimizer slots share the caching allocator's pool with activations (NOTE: [Slots]
    # in runtime/store.py); growable segments keep its reserved memory near what is allocated.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv  # `train --nproc-per-node` starts each rank with the same arguments
    if args.command == "train":
        if args.resume and not args.checkpoint_dir:
            p.error("--resume continues the run in --checkpoint-dir; pass --checkpoint-dir DIR")
        if args.new_lr_schedule and not args.resume:
            p.error("--new-lr-schedule changes the LR schedule of a resumed run; pass it with --resume, or drop it")
        from lazytrain.train.resume import DEFAULT_STEPS

        if args.clipping is not None and args.max_grad_norm is None:
            p._commands["train"].error(f"--clipping {args.clipping} chooses how --max-grad-norm clips; pass "
                                       "--max-grad-norm N with it, or drop --clipping")
        args.clipping = args.clipping or "exact"
        for flag in ("eval_every", "eval_steps"):
            if getattr(args, flag) is not None and not args.eval_data:
                p._commands["train"].error(f"--{flag.replace('_', '-')} sets how --eval-data is evaluated; pass "
                                           "--eval-data FILES with it, or drop it")
        steps = args.steps if args.steps is not None else None if args.resume else DEFAULT_STEPS
        if args.warmup_steps is not None and steps is not None and args.warmup_steps > steps:
            p._commands["train"].error(f"--warmup-steps {args.warmup_steps} is longer than the run's {steps} steps; "
                                       f"pass at most {steps}")
    try:
        return args.fn(args)
    except LazytrainError as exc:
        from lazytrain.train import distributed

        if isinstance(exc, distributed.PeerFailed):  # rank 0 says what another rank's failure was
            distributed.await_report()
        else:
            text = " ".join(str(exc).split())  # one line, whatever a quoted foreign message held
            print(f"lazytrain: error: {text}", file=sys.stderr, flush=True)
            distributed.reported()
        return 2
    except OSError as exc:  # NOTE: [Full disk] in files.py: writes that know no size end here
        from lazytrain.files import is_disk_full

        if not is_disk_full(exc):
            raise
        print(f"lazytrain: error: no space left on the disk to write {exc.filename or 'a file'}; free space on that "
              "disk, or write elsewhere", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lazytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
