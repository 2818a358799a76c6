"""`dflash eval`: real speculative decoding of a trained draft next to its target (a sync point by design).

Prompts are the first user turn of held-out conversations (or any source `load_conversations`
reads), rendered with the target's chat template, or the token ids given for a held-out token row
(`corpus.speculative_entries`). Every speculative output is checked against the target's own greedy
output token for token (`LosslessError` otherwise).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash.config import DataSettings
from dflash.data.corpus import held_out_conversations, speculative_entries
from dflash.data.regenerate import prompt_turns, stop_token_ids
from dflash.data.sources import load_conversations
from dflash.evaluation.export import check_compatible, exported_folder, load_exported, trained_held_out_split, trained_target
from dflash.evaluation.speculative import evaluate_speculative
from dflash.files import write_atomic
from dflash.run.folder import REPORT_NAME, new_report_path
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.loading import load_target
from dflash.target_model.tp_decode import decode_report, decode_session, eval_tensor_parallel, load_sharded_target

log = logging.getLogger(__name__)


def prompt_ids(tokenizer: Any, conversations: list[dict[str, Any]], num_prompts: int,
               max_prompt_tokens: int = 512) -> list[list[int]]:
    """Token ids of the first user turn (plus a leading system turn) of each conversation, chat-rendered (with
    its tools list, when it has one), or the ``prompt_ids`` of an entry that gives them (a held-out token row,
    `corpus.speculative_entries`), used as given: the first `num_prompts` distinct ones of at most
    `max_prompt_tokens` tokens.

    A repeated prompt is skipped and counted: greedy decoding gives it the same output again, so it would
    only weigh τ toward itself (chat data repeats its openers). The held-out chain τ̂ scores each
    regenerated prompt once too."""
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    skipped = {"no user turn": 0, "empty or too long": 0, "duplicate prompt": 0}
    for conv in conversations:
        if "prompt_ids" in conv:
            ids = tuple(conv["prompt_ids"])
        else:
            prompt = prompt_turns(conv["messages"], 1)  # the rule the held-out split and regeneration key prompts by
            if not any(m["role"] == "user" for m in prompt):
                skipped["no user turn"] += 1
                continue
            tools = {"tools": conv["tools"]} if conv.get("tools") else {}  # the serving prompt lists them too
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **tools)
            ids = tuple(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not 0 < len(ids) <= max_prompt_tokens:
            skipped["empty or too long"] += 1
        elif ids in seen:
            skipped["duplicate prompt"] += 1
        else:
            seen.add(ids)
            prompts.append(list(ids))
        if len(prompts) == num_prompts:
            break
    if any(skipped.values()):
        log.info("speculative prompts: %d taken, skipped %s", len(prompts), {k: v for k, v in skipped.items() if v})
    if not prompts:
        raise ValueError("no usable prompts (each needs a user turn within max_prompt_tokens)")
    return prompts


def speculative_report(target_model: Any, tokenizer: Any, draft: torch.nn.Module, conversations: list[dict[str, Any]],
                       *, num_prompts: int = 20, max_new_tokens: int = 128, return_texts: bool = False,
                       max_prompt_tokens: int = 512) -> dict[str, Any]:
    """tau, acceptance histogram, per-position acceptance, speed-up on `num_prompts` prompts (lossless-checked;
    `prompt_ids`, of at most `max_prompt_tokens` tokens); `return_texts`: also the (prompt, output) token ids, see
    `evaluate_speculative`."""
    prompts = prompt_ids(tokenizer, conversations, num_prompts, max_prompt_tokens)
    draft.eval()
    report = evaluate_speculative(target_model, draft, prompts, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop_token_ids(target_model, tokenizer), return_texts=return_texts)
    report["lossless"] = True  # evaluate_speculative raises LosslessError otherwise (rounding ties are listed)
    return report


def held_out_speculative_eval(target: Any, tokenizer: Any, draft: torch.nn.Module, conversations: list[dict[str, Any]], *,
                              rank: int, num_prompts: int, max_new_tokens: int,
                              chain_tau: Callable[[list[tuple[list[int], list[int]]]], float] | None = None,
                              max_prompt_tokens: int = 512) -> dict[str, Any] | None:
    """SYNC POINT: a training run's real speculative decoding on its held-out prompts (`DFlashTrainer`).

    `target`: the run's `FrozenTarget` (or tensor-parallel target). The report on rank 0, None on the other
    ranks: call it on every rank (under tensor_parallel the other ranks of rank 0's group run the sharded
    target with it in lockstep, `dflash.target_model.tp_decode`). `chain_tau(texts)`, when given, scores the decoded
    (prompt, output) pairs teacher-forced: the held-out chain estimate on exactly these prompts and
    outputs, so that what separates it from the real tau is numerics alone (`teacher_forced_chain_tau`).
    `max_prompt_tokens`: the longest prompt decoded (`prompt_ids`)."""
    with decode_session(target, rank) as target_model:
        if target_model is None:
            return None
        report = speculative_report(target_model, tokenizer, draft, conversations, num_prompts=num_prompts,
                                    max_new_tokens=max_new_tokens, return_texts=True,
                                    max_prompt_tokens=max_prompt_tokens)
    texts = report.pop("texts")
    if chain_tau is not None:
        report["teacher_forced_chain_tau"] = chain_tau(texts)
    log.info("speculative eval: %s", format_report(report))
    return report


def format_report(r: dict[str, Any]) -> str:
    per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
    ties = r.get("numerical_ties") or []
    checked = f"lossless, {len(ties)} prompt(s) parted at a rounding tie" if ties else "lossless"
    chain = r.get("teacher_forced_chain_tau")
    checked += f"; teacher-forced chain tau on these outputs {chain:.3f}" if chain is not None else ""
    return (f"tau {r['tau']:.3f} over {r['num_prompts']} prompts ({r['new_tokens']} new tokens, {checked}) | "
            f"speed-up x{r['speedup']:.2f} ({r['speculative_tokens_per_s']:.1f} vs {r['target_tokens_per_s']:.1f} tok/s)\n"
            f"per-position acceptance: {per_pos}\nacceptance histogram (1, 2, ...): {r['acceptance_histogram']}")


def eval_conversations(prompts: str, draft_dir: str | Path, held_out_size: int = 64) -> list[dict[str, Any]]:
    """The conversations whose first user turns `dflash eval` decodes. "auto": the held-out split the
    draft's run recorded (`dflash_config.held_out_split`: the prompts of its own end-of-run evaluation, in
    its order), else chitchat's; "chitchat": chitchat's held-out split of `held_out_size` conversations
    (never trained on by a run on all of chitchat); otherwise a conversations (or token rows) file or folder."""
    split = trained_held_out_split(draft_dir) if prompts == "auto" else None
    if split is not None:
        log.info("prompts: the held-out split of the draft's run (%s)", split)
        try:
            return held_out_conversations(split)
        except (OSError, TypeError, ValueError) as e:  # a source not on this machine; keys of another version
            raise ValueError(f"the draft's held-out prompts come from data.source={split['source']!r}, not "
                             f"readable here ({e}); pass --prompts chitchat or --prompts FILE") from e
    if prompts in ("auto", "chitchat"):
        return held_out_conversations(DataSettings(source="chitchat", eval_size=held_out_size).held_out_split())
    return speculative_entries(load_conversations(prompts, require_assistant=False)[0])


def check_writable(path: Path) -> None:
    """Make `path`'s folder and check a file can be written in it (an OSError naming the path if not);
    the check's file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}-"):
        pass


def write_new_report(folder: Path, name: str, text: str) -> Path:
    """Write `text` to `new_report_path(folder, name)`, created afresh (exclusive create: never replacing a file
    nor writing through a link; another evaluation that took the name meanwhile moves this one on); returns it."""
    while True:
        path = new_report_path(folder, name)
        try:
            with path.open("x") as f:
                f.write(text)
            return path
        except FileExistsError:
            continue


def write_report(report: dict[str, Any], out: str | Path | None, folder: Path, name: str) -> Path:
    """Write `report` as JSON to `out`, replaced (the path the user named), else beside the draft in `folder` as
    `name` or its first free `-N` (`write_new_report`); log where, and that an earlier report was kept."""
    text = json.dumps(report, indent=2)
    if out:
        write_atomic(out, text)
        path = Path(out)
    else:
        path = write_new_report(folder, name, text)
    log.info("wrote %s%s", path, "" if out or path.name == name else
             f" (the earlier {folder / name} is kept; --out names the report's path)")
    return path


def run_eval(draft_dir: str | Path, *, target: str | None = None, prompts: str = "auto", num_prompts: int = 20,
             max_new_tokens: int = 128, device: str = "auto", dtype: str = "auto", out: str | Path | None = None,
             held_out_size: int = 64, tensor_parallel: int | None = None, write: bool = True) -> dict[str, Any]:
    """Load target + exported draft, run the lossless speculative evaluation, write JSON next to the draft.

    Under torchrun / accelerate launch the target is sharded over `tensor_parallel` processes (default: all
    launched): rank 0 decodes, the others run the sharded target with it in lockstep (`dflash.target_model.tp_decode`);
    every rank returns the report, rank 0 writes it: to `out` (replaced), else to `new_report_path` (DRAFT/eval.json,
    or eval-N.json beside an earlier report). `prompts`: see `eval_conversations`. `write=False`: only return the
    report (`dflash eval --engine vllm` writes it inside its own, `engine_eval.run_engine_eval`)."""
    draft_dir = exported_folder(draft_dir)  # an export or a run folder's; what --draft is otherwise, said now
    path = Path(out) if out else new_report_path(Path(draft_dir), REPORT_NAME)
    if write and (not dist.is_initialized() or dist.get_rank() == 0):
        check_writable(path)  # the report is written after minutes of decoding: a bad --out fails now
    conversations = eval_conversations(prompts, draft_dir, held_out_size)  # before any weight is read
    if target is None:  # the target the draft was trained for (its config.json), else the embedded one
        target = trained_target(draft_dir) or "embedded"
        log.info("target: %s (%s)", target, "from the draft's config.json" if trained_target(draft_dir) else "default")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    draft = load_exported(draft_dir, device=dev, dtype=torch_dtype)
    if (tp := eval_tensor_parallel(tensor_parallel)) > 1:
        model, tokenizer = load_sharded_target(target, draft.config.target_layer_ids, tp, device=dev, dtype=torch_dtype)
    else:
        model, tokenizer = load_target(target, torch_dtype)
        model.to(dev).eval()
    check_compatible(draft.config, model)
    run = lambda m: speculative_report(m, tokenizer, draft, conversations, num_prompts=num_prompts,
                                       max_new_tokens=max_new_tokens)
    report = decode_report(model, run) if tp > 1 else run(model)
    if write and (not dist.is_initialized() or dist.get_rank() == 0):
        write_report(report, out, Path(draft_dir), REPORT_NAME)
    return report
