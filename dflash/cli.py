"""Command line: `dflash train [CONFIG.yaml] [key=value ...] [--dry-run]` and friends.

The CLI only parses arguments and calls the library; every behaviour lives in a module.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dflash.config import TrainConfig


def _train(args: argparse.Namespace) -> int:
    config = TrainConfig.from_sources(args.config, args.overrides)
    if args.dry_run:
        from dflash.plan import describe_plan, plan

        print(describe_plan(plan(config)))
        return 0
    from dflash.trainer import DFlashTrainer

    summary = DFlashTrainer(config).fit()
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Sync-free DFlash / Domino draft training")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a draft (no arguments: the embedded SmolLM2 + chitchat default)")
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 draft.num_layers=2")
    train.add_argument("--dry-run", action="store_true", help="print the plan (target, layers, sizes) and exit")
    train.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    # `dflash train key=value` without a YAML: argparse takes the first override as the config.
    if getattr(args, "config", None) and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"dflash {args.command}: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
