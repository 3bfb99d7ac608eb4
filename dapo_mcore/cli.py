"""`dapo-mcore`: the command line.

    dapo-mcore train CONFIG.yaml [section.key=value ...]     run DAPO (single process, or under torchrun/srun)
    dapo-mcore config CONFIG.yaml [section.key=value ...]    print the resolved config
    dapo-mcore keys [PREFIX]                                 config keys with their defaults and descriptions
    dapo-mcore eval MODEL --data FILE.jsonl [...]            avg@k / pass@k / maj@k of a model on prompt files
    dapo-mcore checkpoint verify PATH [...]                  check saves (sizes, CRC-32) without loading them
    dapo-mcore plan CONFIG.yaml [overrides] [--gpu-gb 80]    per-GPU memory of a layout, without a GPU
    dapo-mcore check CONFIG.yaml [section.key=value ...]     every file the run reads is in place (before sbatch)
    dapo-mcore plot RUN_DIR [--keys K ...] [--out FILE]      the run's metrics as a grid of plots, or chosen ones
    dapo-mcore rehearse CONFIG.yaml [--mode full-count] [...]  the recipe's real counts through the loop on the CPU

Bad input (config, data, layout, checkpoint) ends with one line naming the problem and exit code 2; a rollout
engine that fails ends with one line naming the engine, the call and the cause (its traceback logged above
it) and exit code 3; 75: saved and stopped early, run again; 76: a peer rank was lost (its node died:
parallel.peer_timeout_s), resume from the newest save; 130 / 143: stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import sys

from dapo_mcore.utils.errors import DapoError


def main(argv: list[str] | None = None) -> int:
    from dapo_mcore.launch import (
        RESUME_EXIT_CODE,
        StoppedToResume,
        claim_first_error,
        install_stop_handlers,
        leave_with_exit_code,
    )
    from dapo_mcore.utils.processes import Terminated, die_with_launcher

    as_command = argv is None  # not called from Python (tests): this process is the run, its children ours
    args = _parse(_parser(), argv)
    if as_command:
        install_stop_handlers()  # SIGUSR1 / SIGTERM / SIGINT: save at the next step boundary, exit 75
        die_with_launcher()  # under torchrun: its death is a SIGTERM
    rank = os.environ.get("RANK", "0")
    try:
        return args.func(args)
    except DapoError as err:
        if as_command:
            leave_with_exit_code()  # a launcher's SIGTERM to the ranks still leaving must not change their code
        first = claim_first_error(err.exit_code, str(err)) if as_command else None
        if first if first is not None else os.environ.get("WORLD_SIZE", "1") == "1" or rank == "0":
            print(f"dapo-mcore: error: {err}", file=sys.stderr)
        elif not err.same_on_every_rank:
            print(f"dapo-mcore: error (rank {rank}): {err}", file=sys.stderr)
        return err.exit_code
    except StoppedToResume as stop:
        if rank == "0":
            print(f"dapo-mcore: {stop}; run the same command again (checkpoint.resume=auto) to continue",
                  file=sys.stderr)  # fmt: skip
        return RESUME_EXIT_CODE
    except (KeyboardInterrupt, Terminated) as stop:
        if (gone := _gone_peer()) is not None:  # the launcher ended this rank because another one died
            return gone
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else stop.signal_name
        return _stopped_by(name, rank, as_command)
    except Exception as err:
        if (gone := _gone_peer()) is not None:  # a collective failed because another rank died: that is the news
            return gone
        if (name := _stopping_signal(err)) is not None:  # a peer left on the same signal while this rank waited
            return _stopped_by(name, rank, as_command)
        raise


def _stopped_by(name: str, rank: str, as_command: bool) -> int:
    from dapo_mcore.utils.processes import end_children

    if as_command:
        # what the unwinding did not stop (e.g. the checkpoint writer's helpers); not on a normal end, where
        # wandb's own exit handler still needs its service process
        end_children()
    if rank == "0":
        print(f"dapo-mcore: stopped by {name}; the saves already complete are kept (a run continues from the "
              "newest with checkpoint.resume=auto)", file=sys.stderr)  # fmt: skip
    return 130 if name == "SIGINT" else 143


def _stopping_signal(err: Exception) -> str | None:
    """The signal this rank was stopping on when a collective broke because a peer had left (gloo: "Connection
    closed by peer"), else None. A signal reaches the ranks one by one (torchrun's death is each rank's SIGTERM):
    a peer that stops at once leaves this rank inside a C++ collective, which fails before its own signal's
    handler can run, and the traceback hid the stop."""
    from dapo_mcore.launch import requested_stop, stops_at_once

    peer_left = any(words in str(err) for words in ("Connection closed by peer", "Connection reset by peer"))
    reason = requested_stop()
    if not peer_left or reason is None:
        return None
    return stops_at_once(reason) or (reason if reason in ("SIGTERM", "SIGINT") else None)


def _gone_peer() -> int | None:
    """A rank of this host whose process is gone (killed from outside: the OOM killer), named in one line by the
    first survivor to ask; the exit code of a lost peer (76: resume from the newest save), or None."""
    if "dapo_mcore.parallel.state" not in sys.modules:  # no process group was made: no peer to lose
        return None
    from dapo_mcore.parallel import PEER_LOST_EXIT_CODE
    from dapo_mcore.parallel.state import gone_peer

    line = gone_peer()
    if line is None:
        return None
    if line:  # "" on the other survivors: one line for the job
        print(f"dapo-mcore: {line}", file=sys.stderr, flush=True)
    return PEER_LOST_EXIT_CODE


# `--help` epilogs: real commands a user can paste from the repository root
_EXAMPLES = {
    "dapo-mcore": """\
examples:
  dapo-mcore train examples/smoke_cpu.yaml                       the CPU demo (60 steps, runs/smoke_cpu/)
  dapo-mcore plan examples/dapo_qwen2.5_7b_h100.yaml --gpus 8 --model-config examples/models/Qwen2.5-7B
  dapo-mcore check examples/dapo_qwen2.5_7b_h100.yaml            before sbatch, where the job's files are
  dapo-mcore eval examples/models/tiny-arith --data examples/data/sums.jsonl --k 8 --max-new-tokens 32 --top-p 1.0
  dapo-mcore keys algorithm.overlong                             keys with their defaults and descriptions
  dapo-mcore plot runs/smoke_cpu --keys 'time/*' actor/entropy   chosen metrics, one panel each
  dapo-mcore rehearse examples/dapo_qwen2.5_32b_h100.yaml --gpus 32 --model-config examples/models/Qwen2.5-32B
""",
    "rehearse": """\
examples:
  dapo-mcore rehearse examples/dapo_qwen2.5_7b_h100.yaml --model-config examples/models/Qwen2.5-7B
  dapo-mcore rehearse examples/dapo_qwen2.5_32b_h100.yaml --gpus 32 --model-config examples/models/Qwen2.5-32B \\
      --mode full-count --mean-len 8192
  dapo-mcore rehearse examples/dapo_qwen3_30b_a3b_h100.yaml model.routing_replay=rollout \\
      --model-config examples/models/Qwen3-30B-A3B
""",
    "train": """\
examples:
  dapo-mcore train examples/smoke_cpu.yaml
  dapo-mcore train examples/smoke_cpu.yaml trainer.steps=5 logging.wandb.mode=disabled logging.run_dir=/tmp/try
  dapo-mcore train examples/smoke_cpu.yaml checkpoint.resume=auto     continue from the newest save
  sbatch --nodes=1 slurm/train.sbatch examples/dapo_qwen2.5_7b_h100.yaml   on Slurm: read docs/gpu.md first
""",
    "check": """\
example:
  dapo-mcore check examples/dapo_qwen2.5_7b_h100.yaml logging.run_dir=runs/qwen7b
""",
    "plan": """\
examples:
  dapo-mcore plan examples/dapo_qwen2.5_7b_h100.yaml --gpus 8 --model-config examples/models/Qwen2.5-7B
  dapo-mcore plan examples/dapo_qwen2.5_32b_h100.yaml rollout.engine_tp_size=4 --gpus 32 --gpu-gb 141 \\
      --model-config examples/models/Qwen2.5-32B        141: an H200
""",
    "eval": """\
examples:
  dapo-mcore eval examples/models/tiny-arith --data examples/data/sums.jsonl --k 8 --max-new-tokens 32 --top-p 1.0
  dapo-mcore eval runs/smoke_cpu --data examples/data/sums-eval64.jsonl --k 8 --max-new-tokens 32 --top-p 1.0 \
      --out eval.json
""",
    "plot": """\
examples:
  dapo-mcore plot runs/smoke_cpu                             redraw runs/smoke_cpu/curves.png
  dapo-mcore plot runs/smoke_cpu --keys 'time/*' actor/entropy --out /tmp/times.png
""",
    "keys": """\
examples:
  dapo-mcore keys                       every key
  dapo-mcore keys algorithm.overlong    the soft overlong punishment's keys
  dapo-mcore keys trainer.eval          every key starting so (eval_interval, eval_k, ...)
""",
}


def _parser() -> argparse.ArgumentParser:
    parser = _command_parser(argparse.ArgumentParser, "dapo-mcore", description="DAPO RL training on Megatron-Core")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, func, help_ in (
        ("train", _train, "run DAPO training"),
        ("config", _show_config, "print the resolved config"),
        ("check", _check, "everything train would refuse before its first step, listed in one pass (no GPU)"),
    ):
        cmd = _command_parser(sub.add_parser, name, help=help_)
        cmd.add_argument("config", help="recipe YAML (see examples/)")
        cmd.add_argument("overrides", nargs="*", help="section.key=value overrides")
        cmd.set_defaults(func=func)
        if name == "check":
            cmd.add_argument("--gpus", type=_count, help="GPUs of the job (default: WORLD_SIZE, SLURM_NTASKS, else 8)")
            cmd.add_argument("--gpu-gb", type=_size, default=80.0, help="memory of one GPU in GiB (default 80: H100)")
    keys = _command_parser(sub.add_parser, "keys", help="list config keys with their defaults and descriptions")
    keys.add_argument("prefix", nargs="?", default="", help="only the keys starting with it, e.g. algorithm.overlong")
    keys.set_defaults(func=_list_keys)
    _add_eval_parser(sub)
    _add_plan_parser(sub)
    _add_plot_parser(sub)
    _add_rehearse_parsers(sub)
    ckpt = sub.add_parser("checkpoint", help="check saves without loading them")
    ckpt_sub = ckpt.add_subparsers(required=True, metavar="ACTION")
    verify = ckpt_sub.add_parser("verify", help="sizes and CRC-32 of every file of a save, its saves, or a run's")
    verify.add_argument("paths", nargs="+", help="a save (step_N/), a checkpoint directory or a run directory")
    verify.set_defaults(func=_verify_checkpoints)
    return parser


def _add_eval_parser(sub) -> None:
    # validation's defaults, from the config schema (EvalSettings takes the same ones; not a third copy)
    from dapo_mcore.config.schema import RolloutConfig, TrainerConfig

    cmd = _command_parser(sub.add_parser, "eval", help="avg@k, pass@k and maj@k of a model on prompt files")
    cmd.add_argument(
        "model", help="HF model directory, Megatron-Core checkpoint / run save (step_N/), or run directory"
    )
    cmd.add_argument("--data", nargs="+", required=True, help="prompt files (.jsonl of {prompt, answer})")
    cmd.add_argument("--k", type=_count, default=TrainerConfig.eval_k, help="answers per problem (default %(default)s)")
    cmd.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm", "sglang"],
        help="rollout engine that generates (default %(default)s)",
    )
    cmd.add_argument(
        "--verifier", default="dapo", help="dapo, math_verify, gsm8k or module:function (default %(default)s)"
    )
    cmd.add_argument(
        "--source-verifier", action="append", default=[], metavar="SOURCE=VERIFIER",
        help="rows whose data_source is SOURCE are checked by VERIFIER (repeatable; the others by --verifier), and "
             "each source of a file gets its own FILE[SOURCE] row (default: none)",
    )  # fmt: skip
    cmd.add_argument(
        "--correct-threshold", type=float, default=0.5,
        help="a verifier's number (or a dict's score) from this on counts as correct (default %(default)s)",
    )  # fmt: skip
    cmd.add_argument(
        "--also-verifier", action="append", default=[], choices=["dapo", "gsm8k"], metavar="RULE",
        help="check the same answers by this rule too (dapo or gsm8k; repeatable): e.g. gsm8k's last number beside "
             "dapo's strict 'Answer:' form, as FILE:RULE rows (default: none)",
    )  # fmt: skip
    paper = "(default %(default)s: the DAPO paper's AIME evaluation, avg@32 at temperature 1.0, top-p 0.7)"
    cmd.add_argument("--temperature", type=float, default=TrainerConfig.eval_temperature, help=f"sampling {paper}")
    cmd.add_argument("--top-p", type=float, default=TrainerConfig.eval_top_p, help=f"nucleus sampling {paper}")
    cmd.add_argument(
        "--max-new-tokens", type=_count, default=1024, help="longest answer in tokens (default %(default)s)"
    )
    cmd.add_argument(
        "--template", default="none", choices=["none", "chat"],
        help="chat: wrap each problem in the model's chat template (default %(default)s: plain text)",
    )  # fmt: skip
    cmd.add_argument(
        "--instruction", default="none", help="none, dapo, or a text with {problem} in it (default %(default)s)"
    )
    cmd.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    cmd.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights' dtype (default %(default)s)",
    )
    cmd.add_argument(
        "--seed", type=int, default=RolloutConfig.seed, help="sampling seed (default %(default)s, rollout.seed's)"
    )
    cmd.add_argument("--out", help="write the results as JSON here (default: printed only)")
    cmd.add_argument(
        "--save-answers", metavar="FILE.jsonl",
        help="write every answer here, one JSON object each (prompt, answer, ground truth, extracted answer, "
        "verdict; default: not written)",
    )  # fmt: skip
    cmd.add_argument("--no-verify", action="store_true", help="read a save without checking its CRC-32 checksums "
                     "first (by default a damaged save is refused, as `checkpoint verify` would)")  # fmt: skip
    cmd.set_defaults(func=_eval)


def _add_plan_parser(sub) -> None:
    from dapo_mcore.plan_time import (  # plain arithmetic, no torch
        DEFAULT_CPU_THREADS,
        DEFAULT_KEEP_RATE,
        DEFAULT_MEAN_LEN,
        DEFAULT_MFU,
    )

    cmd = _command_parser(
        sub.add_parser, "plan", help="per-GPU memory of actor and engine for a config (no GPU needed)"
    )
    cmd.add_argument("config", help="recipe YAML (see examples/)")
    cmd.add_argument("overrides", nargs="*", help="section.key=value overrides")
    cmd.add_argument("--gpu-gb", type=_size, default=80.0, help="memory of one GPU in GiB (default 80: H100)")
    cmd.add_argument("--model-config", help="config.json or its directory, when model.hf_path has no weights yet")
    cmd.add_argument("--gpus", type=_count, help="GPUs of the job (default: WORLD_SIZE, SLURM_NTASKS, else 8)")
    cmd.add_argument("--mean-len", type=_count, default=DEFAULT_MEAN_LEN,
                     help=f"mean answer length the step-time estimate assumes (default {DEFAULT_MEAN_LEN}: late in "
                     "a run; about 1000 at its start)")  # fmt: skip
    cmd.add_argument("--keep-rate", type=_share, default=DEFAULT_KEEP_RATE,
                     help=f"share of groups dynamic sampling keeps (default {DEFAULT_KEEP_RATE})")  # fmt: skip
    cmd.add_argument("--mfu", type=_share, default=DEFAULT_MFU,
                     help=f"the actor's model FLOPs utilisation (default {DEFAULT_MFU})")  # fmt: skip
    cmd.add_argument("--cpu-threads", type=_count, default=DEFAULT_CPU_THREADS,
                     help="CPUs of a task, on which optimizer.cpu_offload's Adam steps (default "
                     f"{DEFAULT_CPU_THREADS}: slurm/train.sbatch's --cpus-per-task)")  # fmt: skip
    cmd.set_defaults(func=_plan)


def _add_rehearse_parsers(sub) -> None:
    cmd = _command_parser(
        sub.add_parser,
        "rehearse",
        help="the recipe's step at its real counts through the real loop on the CPU: memory and bytes per rank",
    )
    cmd.add_argument("recipe", nargs="?", help="recipe YAML (see examples/); none with --report-only")
    cmd.add_argument("overrides", nargs="*", help="section.key=value overrides of the recipe, right after it (the "
                     "rehearsal's own settings, rehearse/setup.py, come after them)")  # fmt: skip
    cmd.add_argument("--mode", choices=("per-rank", "full-count"), default="per-rank",
                     help="per-rank: each process carries one recipe rank's share, at several N (default); "
                          "full-count: the step's global counts on --world-size processes")  # fmt: skip
    cmd.add_argument("--world-size", type=_count, nargs="+", help="processes (default: 2 4 8 per-rank, 2 full-count)")
    cmd.add_argument("--gpus", type=_count, default=8, help="the recipe's GPUs, whose per-rank share is rehearsed "
                     "and to which growth is projected (default 8; the recipes' headers say theirs)")  # fmt: skip
    cmd.add_argument("--mean-len", type=_size, default=2048, help="mean answer length in tokens (default 2048)")
    cmd.add_argument("--steps", type=_count, help="steps of each run (default: 2 per-rank, 1 full-count)")
    cmd.add_argument("--load", type=_share, help="per-rank: the share of one recipe rank's load each process "
                     "carries (default: about 2M generated tokens a round, at most 1)")  # fmt: skip
    cmd.add_argument("--micro-batches", type=_at_least_zero, default=1, help="micro-batches the actor computes a step "
                     "(trainer.rehearsal_micro_batches; 0: all, for small models and counts)")  # fmt: skip
    cmd.add_argument("--no-save", action="store_true", help="no save at the end and no resume launch")
    cmd.add_argument("--report-only", action="store_true", help="judge the runs of an earlier rehearsal into --out "
                     "again (its arguments from DIR/args.json) without running anything")  # fmt: skip
    cmd.add_argument("--model-config", help="config.json or its directory, when model.hf_path has no weights")
    cmd.add_argument("--gpu-gb", type=_size, default=80.0, help="memory of one GPU for the planner (default 80)")
    cmd.add_argument("--out", help="where the runs and report.md go (default runs/rehearsal/NAME-MODE-LEN)")
    cmd.set_defaults(func=_rehearse)
    rank = sub.add_parser("rehearse-rank")  # what rehearse launches under torchrun; no help: not listed
    rank.add_argument("--records", required=True)
    rank.add_argument("recipe")
    rank.add_argument("overrides", nargs="*")
    rank.set_defaults(func=_rehearse_rank)


def _rehearse(args: argparse.Namespace) -> int:
    from dapo_mcore.rehearse.command import rehearse_command

    return rehearse_command(args)


def _rehearse_rank(args: argparse.Namespace) -> int:
    from dapo_mcore.rehearse.command import rank_command

    return rank_command(args)


def _add_plot_parser(sub) -> None:
    cmd = _command_parser(sub.add_parser, "plot", help="plots of a run's metrics: the default grid or chosen keys")
    cmd.add_argument("run", help="a run directory, or its metrics.jsonl")
    cmd.add_argument(
        "--keys", nargs="+", metavar="KEY",
        help="one panel per metric key or glob (time/*); default: the grid of curves.png",
    )  # fmt: skip
    cmd.add_argument(
        "--out",
        help="PNG to write, or a directory to write it in (default: curves.png, or plot.png with --keys, beside "
        "metrics.jsonl)",
    )
    cmd.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dapo_mcore.utils.errors import ConfigError
    from dapo_mcore.utils.plot import plot_run

    metrics = Path(args.run) / "metrics.jsonl" if Path(args.run).is_dir() else Path(args.run)
    if not metrics.is_file():
        raise ConfigError(f"plot: no metrics file at {metrics} (give a run directory or its metrics.jsonl)")
    default_name = "plot.png" if args.keys else "curves.png"
    out = Path(args.out) if args.out else metrics.parent / default_name
    if out.is_dir() or (args.out or "").endswith("/"):  # --out DIR: the default name inside it (not DIR.png beside)
        out = out / default_name
    if not out.parent.is_dir():
        raise ConfigError(f"plot: --out {out}: no directory {out.parent}")
    panels = plot_run(metrics, out, title=metrics.parent.name, keys=args.keys)
    if not panels:
        raise ConfigError(f"plot: {metrics} has no steps to plot yet")
    print(f"dapo-mcore plot: {out} ({len(panels)} panels: {'; '.join(panel.title for panel in panels)})")
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, with a subcommand's `key=value` overrides taken wherever they stand: after an option
    (`check recipe.yaml --gpus 8 logging.run_dir=x`) argparse left them unrecognized and refused the line."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all(not t.startswith("-") and "=" in t for t in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _number(kind, ok, wanted: str):
    """An argparse type: `kind` of the text, refused in one line unless `ok` (e.g. --gpus -8 planned "DP -4")."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {wanted}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


_count = _number(int, lambda v: v >= 1, "a count >= 1")
_at_least_zero = _number(int, lambda v: v >= 0, "a count >= 0")
_size = _number(float, lambda v: v > 0 and v != float("inf"), "a size > 0")
_share = _number(float, lambda v: 0 < v <= 1, "a share in (0, 1]")


def _command_parser(factory, name: str, **kwargs) -> argparse.ArgumentParser:
    """A parser whose --help ends with the command's examples, kept as written."""
    return factory(name, epilog=_EXAMPLES.get(name), formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dapo-mcore")
    except PackageNotFoundError:  # run from a source tree that was never pip-installed
        return "(not installed)"


def _plan(args: argparse.Namespace) -> int:
    from dapo_mcore.plan import Assumed, plan_command

    assumed = Assumed(mean_len=args.mean_len, keep_rate=args.keep_rate, mfu=args.mfu, cpu_threads=args.cpu_threads)
    return plan_command(args.config, args.overrides, args.gpu_gb, args.model_config, args.gpus, assumed)


def _source_verifiers(pairs: list[str]) -> dict[str, str]:
    from dapo_mcore.utils.errors import ConfigError

    if any("=" not in pair for pair in pairs):
        raise ConfigError(f"eval: --source-verifier takes SOURCE=VERIFIER, got {pairs}")
    return dict(pair.split("=", 1) for pair in pairs)


def _eval(args: argparse.Namespace) -> int:
    from dapo_mcore.evaluate import run_eval
    from dapo_mcore.rewards.by_source import VerifierChoice
    from dapo_mcore.rewards.contract import ScoreRule
    from dapo_mcore.rollout.validation import EvalSettings
    from dapo_mcore.utils.errors import ConfigError

    if args.k < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise ConfigError("eval: need --k >= 1, --max-new-tokens >= 1 and --temperature >= 0")
    settings = EvalSettings(
        k=args.k, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    verifiers = VerifierChoice(args.verifier, _source_verifiers(args.source_verifier),
                               ScoreRule(graded=True, correct_threshold=args.correct_threshold))  # fmt: skip
    run_eval(
        args.model, args.data, args.engine, verifiers, settings,
        template=args.template, instruction=args.instruction, device=args.device, dtype=args.dtype, out=args.out,
        save_answers=args.save_answers, verify=not args.no_verify, also=tuple(args.also_verifier),
    )  # fmt: skip
    return 0


def _verify_checkpoints(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from dapo_mcore.checkpoint.model_checkpoint import dir_bytes, saves_in, verify_complete
    from dapo_mcore.utils.errors import CheckpointError

    damaged = 0
    for save in [s for p in args.paths for s in saves_in(Path(p))]:
        start = time.perf_counter()
        try:
            verify_complete(save, checksums=True)
        except CheckpointError as err:
            damaged += 1
            print(f"DAMAGED  {err}")
            continue
        took = time.perf_counter() - start
        print(
            f"ok       {save}: {dir_bytes(save) / 2**20:.1f} MiB, every file's size and CRC-32 checked in {took:.1f} s"
        )
    return 2 if damaged else 0


def _train(args: argparse.Namespace) -> int:
    from dapo_mcore.config import load_config
    from dapo_mcore.config.validate import run_dir_of
    from dapo_mcore.utils.processes import run_tmp

    cfg = load_config(args.config, args.overrides)
    with run_tmp(str(run_dir_of(cfg)), int(os.environ.get("RANK", "0"))):  # before anything makes a temp file
        from dapo_mcore.trainer import train

        done = train(cfg)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if done.first_step == done.last_step:  # a finished run, run again
        print(f"dapo-mcore: nothing to train: {done.run_dir} is at step {done.first_step} already, trainer.steps "
              "is not higher (raise it to train on)")  # fmt: skip
    else:
        steps = f"{done.first_step + 1}-{done.last_step}" if done.last_step > done.first_step + 1 else done.last_step
        what = "metrics, config and curves" if cfg.logging.plot else "metrics and config"
        print(f"dapo-mcore: run finished: step {steps} trained; {what} in {done.run_dir}")
    return 0


def _check(args: argparse.Namespace) -> int:
    """Everything `train` would refuse before its first step, listed in one pass (dapo_mcore/check.py); run it
    where the job's files are (a login node of the cluster) before sbatch. Exit 2 when anything is listed."""
    from dapo_mcore.check import check_run, format_report
    from dapo_mcore.config import load_config
    from dapo_mcore.utils.errors import ConfigError
    from dapo_mcore.versions import version_line

    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"check: --gpus must be >= 1, got {args.gpus}")
    report = check_run(load_config(args.config, args.overrides), args.gpus, args.gpu_gb)
    report.facts.insert(0, version_line())  # the set of versions found, and whether each is a tested one
    print(format_report(args.config, report), file=sys.stderr if report.problems else sys.stdout)
    return 2 if report.problems else 0


def _show_config(args: argparse.Namespace) -> int:
    import yaml

    from dapo_mcore.config import load_config
    from dapo_mcore.config.loader import config_to_dict

    print(yaml.safe_dump(config_to_dict(load_config(args.config, args.overrides)), sort_keys=False), end="")
    return 0


def _list_keys(args: argparse.Namespace) -> int:
    import textwrap

    from dapo_mcore.config import RunConfig, all_keys
    from dapo_mcore.config.key_docs import key_descriptions
    from dapo_mcore.config.loader import config_to_dict

    keys = _keys_with_prefix(all_keys(), args.prefix)
    defaults, descriptions = config_to_dict(RunConfig()), key_descriptions()
    for key in keys:
        value = defaults
        for part in key.split("."):
            value = value[part]
        print(f"{key} = {value!r}")
        if key in descriptions:
            print(textwrap.fill(descriptions[key], width=116, initial_indent="    ", subsequent_indent="    "))
    return 0


def _keys_with_prefix(keys: list[str], prefix: str) -> list[str]:
    """The keys starting with prefix ('trainer.eval' -> eval_interval, eval_k, ...); none: one line naming the
    closest keys or sections."""
    import difflib

    from dapo_mcore.utils.errors import ConfigError

    chosen = [key for key in keys if key.startswith(prefix)]
    if chosen:
        return chosen
    sections = {key.rsplit(".", 1)[0] for key in keys if "." in key}
    close = difflib.get_close_matches(prefix, sorted(sections) + keys, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `dapo-mcore keys` lists them all"
    raise ConfigError(f"keys: no config key starts with {prefix!r}{hint}")


if __name__ == "__main__":
    sys.exit(main())
