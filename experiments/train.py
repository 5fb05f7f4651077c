"""Train a scaled-down Qwen3-MoE or GLM-4.5-Air model on real text with expert parallelism.

Experts are expert-parallel (the replica substrate of the EP layer: slots, sharded Adam, redistribution into the
next placement); everything else is data-parallel (gradients all-reduced, AdamW). The policy decides placement,
forward routing and what the backward keeps. Each rank draws its own batches from a generator seeded by
(seed, rank), so every policy sees the same data in the same order.

Two architectures run the same loop (data, systems, checkpoints, --resume, records, trace):

* lrmoe's own transformer (lrmoe.integrations.model) of --preset, the default;
* --hf-config qwen3 | glm | PRESET: Hugging Face transformers' Qwen3-MoE or GLM-4.5 (glm4_moe) model of a preset's
  shape (qwen3: qwen3-30b-a3b-debug, glm: glm-4.5-air-debug; lrmoe.integrations.hf.hf_config), its sparse MoE blocks
  swapped
  onto the expert-parallel layer (lrmoe.integrations.hf.swap_moe_blocks; HF's routers, attention and shared experts
  stay HF's).
  Qwen3 adds --aux-coef times HF's load-balancing loss (of each rank's own tokens); GLM balances with its
  selection bias (--bias-rate). Needs the [hf] extra (transformers).

    torchrun --standalone --nproc-per-node 4 experiments/train.py --policy lrmoe --steps 200
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 experiments/train.py ...
    python experiments/train.py --preset qwen3-30b-a3b-debug --policy lrmoe --ranks 4 --steps 200
    python experiments/train.py --hf-config glm --policy symi-dropless --ranks 4 --steps 200

Under torchrun (found from its environment; docs/cluster.md) the script runs as one of torchrun's ranks; otherwise
it forks --ranks gloo ranks on this machine. The ranks form an expert-parallel x data-parallel mesh
(lrmoe.runtime.distributed.mesh): --ep-size ranks per EP group, by default the ranks of a node (LOCAL_WORLD_SIZE),
the whole world when it fits one node.

Logged per step: loss, validation loss (every --eval-every), dropped pairs, retained backward pairs per rank,
throughput, modelled time (--cost-model), load statistics (lrmoe.integrations.load_stats:
"load/<key>_mean|_p50|_p90|_p99"
across layers and the dropped / trimmed totals every step; each layer's "load/layer<i>/<key>" every --eval-every
steps), and the per-layer routing counts, saved as a recorded trace. Sharded checkpoints every --ckpt-every steps,
the newest --ckpt-keep kept (lrmoe.integrations.checkpoint; docs/checkpoints.md); --resume continues from the latest
intact one exactly where it stopped, on the same or another number of ranks (re-sharded).

--micro-batches K splits each rank's --batch sequences of a step into K micro-batches, each with its own forward,
plan and backward, one optimizer step after the last (lrmoe.runtime.layer: the placement holds for the step; the
gradient is that of the mean loss over ranks and micro-batches, so K changes the arithmetic, not the data).
--activation-checkpointing recomputes each transformer block's activations in the backward (torch's non-reentrant
checkpoint; HF's activation_checkpointing_enable()); the MoE layers replay their recorded plans. Per-step records
hold both; their load columns are the last micro-batch's.

--timeout S bounds how long a rank waits for the others in a collective (default 5 minutes), not the run: past it
the run ends naming the rank(s) that did not arrive and where they are (lrmoe.runtime.distributed.launch); a healthy
run of any length is never stopped (--engine emulated: its in-process launcher bounds the whole run instead).
Every argument is checked before any rank starts (argparse errors, status 2), the experts' memory at a step's peak
against what the machine has available too; Ctrl-C ends the run with one line and status 130.

--clip-grad X clips every step's gradient to a global L2 norm of X over the dense parameters and the experts (each
expert once, after its replicas' gradients are summed; lrmoe.runtime.clip), as torch.nn.utils.clip_grad_norm_ would
on the dense model, before the dense and the expert steps; records hold the norm before clipping ("grad_norm").
The budget systems (retention < 1) clip their recalibrated gradient. Off (0) by default: earlier runs' results stay
reproducible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lrmoe.cli import (SYSTEMS_HELP, fraction_arg, non_negative_float_arg, non_negative_int_arg, positive_float_arg,
                       positive_int_arg, script_parser, system_arg)
from lrmoe.config import REPLICA_GRAD_MODES
from lrmoe.training.schedule import LR_SCHEDULES

# The parser is built from light modules alone (lrmoe.cli; tests/test_cli.py): torch, the runtime and the model load
# in check_args and run, so --help and argument errors come back at once. What a rank does is lrmoe.training's.

DEFAULT_PRESET = "qwen3-30b-a3b-debug"
DEFAULT_TIMEOUT_S = 300.0  # --timeout: minutes, so a hung rank is named soon, far above any healthy wait
EMULATED_TIMEOUT_S = 3600.0  # --engine emulated: its in-process launcher bounds the whole run, not each wait
HF_CONFIGS = {"qwen3": "qwen3-30b-a3b-debug", "glm": "glm-4.5-air-debug"}  # --hf-config shorthands
ENGINES = ("distributed", "emulated")  # --engine: how the ranks run (the same worker either way)


def trace_path_arg(text: str) -> str:
    """--trace-out: a trace file's name ends in .npz (lrmoe.integrations.traces), checked before the run trains."""
    if text and Path(text).suffix != ".npz":
        raise argparse.ArgumentTypeError(f"trace files end in .npz, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command line; its flags come from light modules alone (lrmoe.cli; tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/train.jsonl")  # --resume also continues from the latest checkpoint
    parser.add_argument("--preset", default=None, help=f"model preset (default {DEFAULT_PRESET})")
    parser.add_argument("--hf-config", default=None, metavar="FAMILY",
                        help="train Hugging Face transformers' architecture instead of lrmoe's: 'qwen3' (Qwen3-MoE "
                             f"of {HF_CONFIGS['qwen3']}), 'glm' (GLM-4.5, glm4_moe, of {HF_CONFIGS['glm']}) or any "
                             "model preset of either family; its MoE blocks run on the expert-parallel layer "
                             "(lrmoe.integrations.hf; needs the [hf] extra)")
    parser.add_argument("--policy", default="lrmoe", type=system_arg, help=f"the system trained; {SYSTEMS_HELP}")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the fork launcher (not under torchrun)")
    parser.add_argument("--torchrun", action="store_true",
                        help="accepted for older command lines: torchrun is found from its environment")
    parser.add_argument("--ep-size", type=int, default=None, metavar="EP",
                        help="ranks per expert-parallel group; the EP groups are data-parallel copies (default: the "
                             "ranks of a node, LOCAL_WORLD_SIZE under torchrun; the world when it fits a node)")
    parser.add_argument("--engine", choices=ENGINES, default="distributed",
                        help="'distributed': one process per rank (the fork launcher, gloo), the reference for "
                             "exactness and time; 'emulated': the --ranks ranks as threads of this process taking "
                             "turns, every exchange a local gather (lrmoe.runtime.inprocess), the same code")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="split each rank's --batch into this many micro-batches per optimizer step (gradient "
                             "accumulation; the placement holds for the step); must divide --batch")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward (the MoE layers replay their plans)")
    parser.add_argument("--record-peak-rss", action="store_true",
                        help="record each step's peak resident memory above its start (the largest rank's; Linux "
                             "only, CPU ranks; the heap is freed before every step, outside the timed part)")
    parser.add_argument("--lr", type=positive_float_arg, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--clip-grad", type=non_negative_float_arg, default=0.0, metavar="MAX_NORM",
                        help="clip each step's gradient to this global L2 norm over the dense parameters and the "
                             "experts (0: off; Megatron-Core's default is 1.0)")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="'cosine': linear warm-up, then cosine decay to --min-lr-frac x --lr at the last step")
    parser.add_argument("--warmup", type=non_negative_int_arg, default=0, help="warm-up steps of the cosine schedule")
    parser.add_argument("--min-lr-frac", type=positive_float_arg, default=0.1,
                        help="the cosine schedule's final lr / --lr")
    parser.add_argument("--aux-coef", type=non_negative_float_arg, default=0.1,
                        help="global-batch load-balancing loss weight (0.1: recorded Gini 0.3-0.4 on the debug "
                             "models; 1e-3, Qwen3's value at scale, lets the tiny models collapse to Gini 0.65)")
    parser.add_argument("--bias-rate", type=non_negative_float_arg, default=1e-3,
                        help="aux-free selection-bias update rate (GLM; 0: no balancing)")
    parser.add_argument("--extra-slots", type=non_negative_int_arg, default=1,
                        help="replica slots per rank beside E/N home slots (bounded by the memory the ranks' experts "
                             "need at a step's peak: every slot's weights, gradient and working copy in every MoE "
                             "layer, the plans, buffers and optimizer shards)")
    parser.add_argument("--eps", type=non_negative_float_arg, default=0.1,
                        help="LRMoE balance slack (fraction of the mean load a rank may exceed)")
    parser.add_argument("--replica-grad", choices=REPLICA_GRAD_MODES, default="range",
                        help="replica gradients: 'range' (SYMI's range all-reduce, then collection) or 'shard' "
                             "(each host's sum straight to the optimizer-shard owners), for every system")
    parser.add_argument("--gamma", type=fraction_arg, default=0.1,
                        help="LRMoE per-expert floor (fraction of each expert's pairs always kept)")
    # the CPU ranks' figure, as layer_bench.py's (lrmoe.sim.cost.CostModel.push_cost_rows on the CPU calibration)
    parser.add_argument("--push-cost-rows", type=non_negative_float_arg, default=32.0,
                        help="cost-aware online replication pushes a copy only when it relieves the busiest rank by "
                             "more than this many pairs (online-greedy: any relief)")
    parser.add_argument("--cost-model", default="h200x8",
                        help="cluster preset pricing each step's plans as full-size pairs ('' to skip)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between validation losses")
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank per evaluation")
    parser.add_argument("--data", default=None, help="folder or glob of text files (default: Python's stdlib)")
    parser.add_argument("--max-bytes", type=positive_int_arg, default=4_000_000,
                        help="read at most this many bytes of text")
    parser.add_argument("--seed", type=non_negative_int_arg, default=0, help="seed of the model and the data order")
    parser.add_argument("--ckpt-dir", default=None,
                        help="checkpoints of this run (default: beside the results file, --out's name + .ckpt)")
    parser.add_argument("--ckpt-every", type=non_negative_int_arg, default=50,
                        help="steps between checkpoints (0: no checkpoints)")
    parser.add_argument("--ckpt-keep", type=non_negative_int_arg, default=2,
                        help="keep the newest this many checkpoints (0: all; 2 or more lets --resume fall back "
                             "past a corrupted one); each step's record is kept once, whatever this is")
    parser.add_argument("--stop-after", type=non_negative_int_arg, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trace-out", default=None, type=trace_path_arg,
                        help="save the routing counts as a recorded trace (.npz)")
    parser.add_argument("--timeout", type=positive_float_arg, default=None, metavar="SECONDS",
                        help="the longest a rank waits for its peers in a collective: past it the run ends, naming "
                             f"the ranks that did not arrive and where they are (default {DEFAULT_TIMEOUT_S:g}; a "
                             "bound on inactivity, not on the run's length; --engine emulated: a bound on the whole "
                             f"run, default {EMULATED_TIMEOUT_S:g})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no tracking notices")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_config:
        preset = HF_CONFIGS.get(args.hf_config, args.hf_config)
        if args.preset not in (None, preset):
            parser.error(f"--hf-config {args.hf_config} trains {preset}; drop --preset {args.preset}")
        args.preset = preset
    elif args.preset is None:
        args.preset = DEFAULT_PRESET
    for name in ("steps", "batch", "seq_len", "ranks", "eval_every", "eval_batches", "micro_batches"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.batch % args.micro_batches:
        parser.error(f"--micro-batches {args.micro_batches} must divide --batch {args.batch} (sequences per rank)")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    if not 0 < args.min_lr_frac <= 1:
        parser.error(f"--min-lr-frac must be in (0, 1], got {args.min_lr_frac}")
    if args.ckpt_dir is None:
        if args.ckpt_every and not args.out:
            parser.error("--out '' writes no results file: name a --ckpt-dir, or --ckpt-every 0")
        args.ckpt_dir = str(Path(args.out).with_suffix(".ckpt")) if args.out else None
    if args.resume and not args.out:
        parser.error("--resume continues the run of a results file: name it with --out")
    if args.engine == "emulated" and (args.torchrun or args.hf_config):
        parser.error(f"--engine emulated runs lrmoe's own transformer on the fork launcher's --ranks: drop "
                     f"{'--torchrun' if args.torchrun else '--hf-config'}")
    if args.timeout is None:
        args.timeout = EMULATED_TIMEOUT_S if args.engine == "emulated" else DEFAULT_TIMEOUT_S
    return args


def check_args(args) -> None:
    """Everything a rank would otherwise find out on its own, checked once before any rank starts or any record is
    written: the world of the launch and its EP size (lrmoe.training.launch.launch_world), the output paths
    (lrmoe.integrations.tracking_args), the presets, the world size against the experts, the system in that world,
    the experts' memory at a step's peak on this machine (lrmoe.training.sizing.check_slot_memory), the text files
    and their validation split, and which run --resume continues (lrmoe.training.resume.plan_resume: sets
    ``args.run_id`` and ``args.start_step``). SystemExit with one message."""
    from lrmoe.config import cluster_preset, full_scale_preset, model_preset
    from lrmoe.integrations.data import load_corpus
    from lrmoe.integrations.tracking_args import check_tracking_args, output_problem
    from lrmoe.runtime.distributed.mesh import ep_ranks_per_node
    from lrmoe.systems import check_systems
    from lrmoe.training.launch import launch_world
    from lrmoe.training.resume import plan_resume
    from lrmoe.training.sizing import check_slot_memory, system_context

    parser = build_parser()
    try:
        world, rpn, ep = launch_world(args)  # torchrun's environment or --ranks, and --ep-size against them
    except ValueError as exc:
        parser.error(str(exc))
    check_tracking_args(parser, args, "train", {"--trace-out": args.trace_out})
    if args.ckpt_dir and (problem := output_problem("--ckpt-dir", Path(args.ckpt_dir) / "step", replace=True)):
        parser.error(problem)
    try:
        cfg = model_preset(args.preset)
        if args.cost_model:
            cluster_preset(args.cost_model)
            full_scale_preset(args.preset)
        check_systems([args.policy], system_context(args, cfg, ep, ep_ranks_per_node(ep, rpn)))
        check_slot_memory(args, cfg, world, ep)
        if args.hf_config:
            from lrmoe.integrations.hf import hf_config  # imports transformers here, once, before the ranks fork

            hf_config(cfg)  # raises when the preset has no HF counterpart
        corpus = load_corpus(args.data, max_bytes=args.max_bytes)  # raises when it holds no file or is too small
        for split in ("train", "val"):
            if getattr(corpus, split).numel() <= args.seq_len + 1:
                raise ValueError(f"the {split} split of the corpus holds {getattr(corpus, split).numel()} tokens, "
                                 f"too few for one window of --seq-len {args.seq_len}")
        plan_resume(args, world)
    except ImportError as exc:
        raise SystemExit(f"train.py: error: --hf-config needs transformers (pip install 'lrmoe[hf]'): {exc}") from None
    except (ValueError, OSError) as exc:
        parser.error(str(exc))


def run(args) -> list[dict]:
    """Train the run of ``args`` (parsed and checked: :func:`check_args`) on its ranks: as one of torchrun's, or on
    the fork launcher's --ranks processes, or on the emulated engine's in-process ranks (lrmoe.training.launch);
    rank 0's records."""
    from lrmoe.training.launch import run_ranks

    return run_ranks(args)


def _check_and_run(args) -> list[dict]:
    check_args(args)
    return run(args)


def main(argv=None) -> list[dict]:
    """Parse the command line (--help and argparse errors before torch loads), check it, and :func:`run` it; under
    torchrun a failing rank's traceback reaches torchrun's report (lrmoe.runtime.distributed.torchrun.record)."""
    args = parse_args(argv)
    from lrmoe.runtime.distributed.torchrun import record

    return record(_check_and_run)(args)


def cli(argv=None) -> int:
    """The command line: :func:`main`, its exit status. An interrupt (Ctrl-C) ends with one line and status 130, a
    failed rank with the launcher's report (it names the rank and holds its traceback) and status 1, neither with a
    traceback of the launcher's own."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("train.py: interrupted; the checkpoints written so far are kept (--resume continues from the last)",
              file=sys.stderr)
        return 130
    except Exception as exc:
        from lrmoe.runtime.distributed.launch import LaunchError  # loaded by then: the launcher raised it

        if not isinstance(exc, LaunchError):
            raise
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
