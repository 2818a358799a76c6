"""Command line: `dflash train [CONFIG.yaml] [key=value ...] [--dry-run]` and friends (`dflash features`, ...).

The CLI only parses arguments and calls the library; every behaviour lives in a module. A condition the
program can name ends in one line on stderr and an exit code (README, "Exit codes"; `dflash.run.stopping`):
0 done, 2 bad configuration or input, 3 stopped on non-finite updates, 4 output not writable (disk
full, read-only), 128 + N interrupted by signal N after saving (143 SIGTERM, 130 SIGINT).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
import warnings
from pathlib import Path

from dflash.config import TrainConfig


def _train(args: argparse.Namespace) -> int:
    config = TrainConfig.from_sources(args.config, args.overrides)
    if args.dry_run:
        from dflash.cli.dry_run import describe_plan, plan
        from dflash.report.console import process_rank

        if process_rank() == 0:  # under torchrun every rank plans (the same checks); one prints
            print(describe_plan(plan(config)))
        return 0
    from dflash.report.console import process_rank, summary_table
    from dflash.report.sinks import SUMMARY_NAME
    from dflash.run.stopping import EXIT_NONFINITE, NonFiniteError, interrupted_exit_code
    from dflash.runtime import launch_process_group
    from dflash.trainer import DFlashTrainer

    with launch_process_group():  # torchrun: the group goes before the interpreter exits (else SIGABRT)
        try:
            summary = DFlashTrainer(config).fit()
        except NonFiniteError as e:  # the traceback (and the trainer in it) is freed before the group goes
            print(f"dflash train: stopped: {e}", file=sys.stderr)
            return EXIT_NONFINITE
    if process_rank() == 0:  # one table per launch; the full JSON is RUN/summary.json
        print(json.dumps(summary, indent=2) if args.json else summary_table(summary, Path(config.output_dir) / SUMMARY_NAME))
    if summary.get("interrupted"):  # saved; a scheduler requeues it with resume_from=latest
        if process_rank() == 0:  # stderr: stdout stays the table or the JSON
            print(f"dflash train: interrupted by {summary.get('signal')} at step {summary.get('steps')}, saved in "
                  f"{summary.get('checkpoint')}; continue it with:\n  {resume_command(args)}", file=sys.stderr)
        return interrupted_exit_code(summary.get("signal"))
    return 0


# `dflash train` settings a resume command leaves out: resume_from is set to latest, and overwrite_output_dir=true
# beside it is ignored by the run (`dflash.run.folder.claim`) but reads as if it would wipe what it continues.
_NOT_RESUMED = ("resume_from", "overwrite_output_dir")


def launcher() -> str:
    """How this process was started, as the words before `train`: `torchrun --nproc_per_node N -m dflash` under
    torchrun on one node (a rank sees no other launcher option; on several nodes `<torchrun options>` stands for
    them), `python -m dflash` for `python -m dflash`, else `dflash` (the console script)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun's agent for every rank
        local, world = os.environ.get("LOCAL_WORLD_SIZE", "1"), os.environ.get("WORLD_SIZE", "1")
        return f"torchrun {'--nproc_per_node ' + shlex.quote(local) if local == world else '<torchrun options>'} -m dflash"
    by_module = Path(sys.argv[0]).resolve() == Path(__file__).resolve().parent.parent / "__main__.py"  # dflash's own
    return "python -m dflash" if by_module else "dflash"


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues an interrupted `dflash train`: the same launcher, config file and overrides
    (in their order, shell-quoted), and `resume_from=latest` (the newest intact checkpoint of that output_dir)."""
    kept = [word for word in args.overrides if word.split("=", 1)[0].strip() not in _NOT_RESUMED]
    words = [*([args.config] if args.config else []), *kept, "resume_from=latest", *(["--json"] if args.json else [])]
    return f"{launcher()} train {shlex.join(words)}"


def _config(args: argparse.Namespace) -> int:
    from dflash.cli.config_keys import describe_keys

    print(describe_keys())
    return 0


def _eval(args: argparse.Namespace) -> int:
    from dflash.report.console import process_rank
    from dflash.runtime import launch_process_group

    if args.engine == "vllm":  # dflash's own evaluation, then the export served by vLLM: one process, no launcher
        from dflash.evaluation.engine_eval import format_engine_report, run_engine_eval

        print(format_engine_report(run_engine_eval(
            args.draft, target=args.target, prompts=args.prompts, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype, out=args.out)))
        return 0
    from dflash.evaluation.evaluate import format_report, run_eval

    with launch_process_group():  # torchrun shards the target: its group goes before exit
        report = run_eval(args.draft, target=args.target, prompts=args.prompts, num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype,
                          out=args.out)  # target None: the draft's
        rank = process_rank()  # read while the group exists: every rank returns the report, rank 0 prints it
    if rank == 0:
        print(format_report(report))
    return 0


def _export(args: argparse.Namespace) -> int:
    from dflash.evaluation.export import export_checkpoint
    from dflash.evaluation.serving import format_serving

    # weights and config: no optimizer state is read; OUT new, empty or an earlier export unless --overwrite
    path, out = export_checkpoint(args.checkpoint, args.out_dir, overwrite=args.overwrite)
    print(f"exported {path} -> {out}")
    print(format_serving(out))  # the vLLM / SGLang launch commands for this folder
    return 0


def _checked_config(args: argparse.Namespace) -> TrainConfig:
    """The command's config, its packages checked before the target loads (`generate`, `features`)."""
    from dflash.preflight import check_dependencies

    config = TrainConfig.from_sources(args.config, args.overrides)
    check_dependencies(config)
    return config


def _generate(args: argparse.Namespace) -> int:
    from dflash.data.corpus import regenerate_source
    from dflash.runtime import launch_process_group

    config = _checked_config(args)
    with launch_process_group():
        result = regenerate_source(config)
    print(f"{result.path}: {result.written} new replies, {result.reused} reused, skipped {result.skipped}")
    return 0


def _features(args: argparse.Namespace) -> int:
    from dflash.cli.features import train_command, write_run_features
    from dflash.runtime import launch_process_group

    config = _checked_config(args)
    start = time.perf_counter()
    with launch_process_group():
        parts = write_run_features(config)
    print(f"features: {', '.join(str(path) for path in parts.values())} ({time.perf_counter() - start:.1f} s); train "
          f"from them with: {train_command(args.config, args.overrides, config)}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    try:
        from dflash.report.plot import plot_run

        paths = plot_run(args.run_dir, args.out)
    except ImportError as e:  # matplotlib is the optional `plot` extra
        print(f"dflash plot: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Sync-free training of DFlash-family drafts "
                                     "(DFlash, Domino, DFlash 2, DSpark)")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a draft (no arguments: the embedded SmolLM2 + chitchat default)")
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*",
                       help="dotted overrides, e.g. optim.lr=3e-4 draft.num_layers=2 (`dflash config` lists every key)")
    train.add_argument("--dry-run", action="store_true",
                       help="print the plan (target, layers, sizes, phases, time budget) and exit")
    train.add_argument("--json", action="store_true", help="print the final summary as JSON (also RUN/summary.json)")
    train.set_defaults(func=_train)

    keys = sub.add_parser("config", help="list every config key with its default, type and meaning")
    keys.set_defaults(func=_config)

    gen = sub.add_parser("generate", help="answer the dataset's prompts with the target's own greedy replies (cached)")
    gen.add_argument("config", nargs="?", help="YAML config file (optional; same keys as train)")
    gen.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.source=my.jsonl data.limit=1000")
    gen.set_defaults(func=_generate)

    feats = sub.add_parser("features", help="write the target's features of the training (and held-out) rows to "
                           "data.features once; `dflash train data.features=DIR` then trains without the target")
    feats.add_argument("config", nargs="?", help="YAML config file (optional; same keys as train)")
    feats.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.features=features/ data.max_length=512")
    feats.set_defaults(func=_features)

    ev = sub.add_parser("eval", help="real speculative decoding: tau, per-position acceptance, speed-up (lossless)")
    ev.add_argument("--draft", required=True, help="exported draft folder (config.json + model.safetensors)")
    ev.add_argument("--target", help="target model: embedded, an HF id or a path (default: the target the draft "
                    "was trained for, from its config.json; else embedded)")
    ev.add_argument("--prompts", default="auto", help="auto (the held-out prompts of the draft's run, else "
                    "chitchat's), chitchat (its held-out split) or a conversations file/folder")
    ev.add_argument("--num-prompts", type=int, default=20)
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),  # dflash.runtime.DTYPES
                    help="auto: bf16 on a GPU, fp32 on the CPU (both engines run in it)")
    ev.add_argument("--engine", choices=("dflash", "vllm"), default="dflash",
                    help="dflash: dflash's own decoder; vllm: also serve the target in vLLM with the draft as its "
                    "speculative draft and report vLLM's acceptance length, losslessness and tokens/s beside dflash's tau")
    ev.add_argument("--out", help="JSON report path, replaced if present (default: DRAFT/eval.json, or the first free "
                    "DRAFT/eval-N.json when a report is there already; with --engine vllm DRAFT/eval_vllm.json, "
                    "else eval_vllm-N.json)")
    ev.set_defaults(func=_eval)

    ex = sub.add_parser("export", help="write a checkpoint's draft in the published DFlash format; "
                        "print its vLLM and SGLang launch commands")
    ex.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its latest checkpoint)")
    ex.add_argument("out_dir", help="a new or empty folder, or an earlier dflash export (replaced)")
    ex.add_argument("--overwrite", action="store_true", help="write into a folder that is not a dflash export: "
                    "replaces its config.json and model.safetensors, keeps every other file")
    ex.set_defaults(func=_export)

    pl = sub.add_parser("plot", help="PNG plots of a run's metrics (loss, tau, per-position accuracy); needs matplotlib")
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="output folder (default: RUN_DIR/plots)")
    pl.set_defaults(func=_plot)
    return parser


def error_message(e: BaseException) -> str:
    """One line for an error the program can name: an OS error's file and reason (its first argument is
    the errno, which alone read "error: 2"), else the message itself."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e.args[0]) if e.args else str(e)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # `dflash train key=value` without a YAML: argparse takes the first override as the config.
    if getattr(args, "config", None) and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    # The library logs under "dflash"; the command gives it its own handler for its duration (a root
    # handler installed by an imported library would otherwise make basicConfig a no-op and hide the
    # progress lines). Removed afterwards, so calling main() in a process (tests, notebooks) leaves
    # logging as it was.
    logger = logging.getLogger("dflash")
    saved = logger.level, logger.propagate
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    # Under torchrun / accelerate every rank runs this: rank 0 speaks, the others only warn and fail.
    rank = int(os.environ.get("RANK", "0"))
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    if rank != 0:  # nor do the libraries' own bars and notices repeat on every rank
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        warnings.filterwarnings("ignore")
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"dflash {args.command}: error: {error_message(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # output not writable: disk full, read-only, permissions (checkpoints say which)
        print(f"dflash {args.command}: error: {error_message(e)}", file=sys.stderr)
        return 4
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
