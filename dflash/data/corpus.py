"""The data recipe of a run: load conversations, hold some out, regenerate replies, tokenize.

    source --load_conversations--> conversations --stable split--> train / held-out
           --regenerate (optional, cached)--> target's own replies --build_dataset (cached)--> rows

The held-out split is by a hash of each conversation's id, so it does not move when `limit`
changes or the source is reordered. Held-out prompts are regenerated too: held-out tau must be
measured on the distribution the draft will serve (the target's replies). Token rows
(`dflash.data.rows`) take the same split and are trained as given: never regenerated.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash.config import DataSettings
from dflash.data.conversations import conversation_id, regenerate_conversations
from dflash.data.feature_data import FeatureDataset, read_split_record, run_feature_parts
from dflash.data.regenerate import cache_writer, prompt_id, prompt_turns, regenerate
from dflash.data.repliers import TargetIdentity, make_replier, target_identity
from dflash.data.rows import first_prompt, is_token_row, last_turn_prompt, token_prompt_id
from dflash.data.sources import load_conversations
from dflash.data.tokenization import build_dataset, check_token_absent
from dflash.data.tool_calls import uses_tools
from dflash.embedded import cache_root, cache_slug, embedded_conversations
from dflash.engines import Replier
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.loading import load_target, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    train: Any  # datasets.Dataset with input_ids, loss_mask
    eval: Any | None
    description: dict[str, Any]
    # The speculative evaluation's prompts (`speculative_entries`): conversations (their first user turns) or
    # {"id", "prompt_ids"} of held-out token rows
    held_out_conversations: list[dict[str, Any]]
    held_out_split: dict[str, Any] | None = None  # the settings that chose them (`DataSettings.held_out_split`)


def _stable_key(conv_id: str) -> str:
    return hashlib.sha1(conv_id.encode()).hexdigest()


def first_prompt_id(conversation: dict[str, Any]) -> str:
    """`prompt_id` of a conversation's first user turn (with a leading system turn): the speculative
    evaluation's prompt for a held-out conversation. A token row's: the hash of its ids before its first
    supervised token (`rows.token_prompt_id`)."""
    if is_token_row(conversation):
        return token_prompt_id(first_prompt(conversation))
    return prompt_id(prompt_turns(conversation["messages"], 1))


def _has_prompt(row: dict[str, Any]) -> bool:
    """Whether a row opens with a prompt: a conversation's user turn, a token row's unsupervised ids."""
    return bool(first_prompt(row)) if is_token_row(row) else any(m["role"] == "user" for m in row["messages"])


def speculative_entries(held_out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the speculative evaluation decodes of held-out rows (`evaluation.evaluate.prompt_ids`): a conversation
    as it is (its first user turn is rendered), a token row as ``{"id", "prompt_ids"}``, the ids before its last
    run of supervised tokens (`rows.last_turn_prompt`: a multi-turn row's whole history before its last reply)."""
    return [{"id": row["id"], "prompt_ids": last_turn_prompt(row)} if is_token_row(row) else row for row in held_out]


def split_held_out(conversations: list[dict[str, Any]], eval_size: int) -> tuple[list[dict], list[dict]]:
    """(train, held_out): the `eval_size` conversations with the smallest id hashes are held out, and no
    training conversation opens with a held-out prompt.

    Chat data repeats openers. Greedy regeneration gives a repeated prompt the identical reply, so a
    training row opening with a held-out prompt holds the very text the speculative evaluation decodes for
    it, and the draft's τ on that prompt measures memorization, not drafting. Those training conversations
    are dropped (logged with a count)."""
    order = sorted(range(len(conversations)), key=lambda i: _stable_key(str(conversations[i].get("id", i))))
    held = set(order[: min(eval_size, max(0, len(conversations) - 1))])
    held_out = [c for i, c in enumerate(conversations) if i in held]
    prompts = {first_prompt_id(c) for c in held_out if _has_prompt(c)}
    train = [c for i, c in enumerate(conversations) if i not in held and first_prompt_id(c) not in prompts]
    dropped = len(conversations) - len(held_out) - len(train)
    if dropped:
        log.info("held-out split: %d training conversations dropped for opening with one of the %d held-out "
                 "prompts", dropped, len(prompts))
    if conversations and not train:
        raise ValueError(f"every training conversation opens with a held-out prompt ({len(conversations)} "
                         "conversations); use a smaller data.eval_size or more varied data")
    return train, held_out


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """`rows` (conversations with their tools, or token rows) as a JSONL file `load_conversations` reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            fields = {k: row[k] for k in ("messages", "tools", "input_ids", "loss_mask") if k in row}
            f.write(json.dumps({"id": row.get("id"), **fields}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _conversations(settings: DataSettings) -> tuple[list[dict[str, Any]], int]:
    """The source's conversations (limited) and how many the source had."""
    conversations = embedded_conversations(settings.source)
    if conversations is None:
        conversations, _ = load_conversations(settings.source, settings.split)
    conversations = list(conversations)
    return conversations[: settings.limit] if settings.limit is not None else conversations, len(conversations)


def split_conversations(settings: DataSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, int]:
    """(training, held-out conversations, conversations used, conversations in the source): the source
    limited to `data.limit`, then `split_held_out`. The one place a run's split is made from its settings."""
    conversations, available = _conversations(settings)
    train, held = split_held_out(conversations, settings.eval_size)
    return train, held, len(conversations), available


def held_out_conversations(split: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out conversations of a recorded split (`DataSettings.held_out_split`), in the order a run's
    speculative evaluation takes its prompts from them (the first `spec_eval_prompts`), as `Corpus` holds them
    (`speculative_entries`)."""
    return speculative_entries(split_conversations(DataSettings(**split))[1])


TOOL_REGENERATION = ("conversations with tool calls are regenerated whole (data.regenerate_turns=all); set "
                     "data.regenerate=false to train their recorded assistant turns")


def check_tool_regeneration(settings: DataSettings, rows: list[dict[str, Any]]) -> None:
    """Refuse regenerating conversations that use tools turn by turn from their user turns alone
    (`data.regenerate_turns` a number), which would drop the calls, their results and the tools list (ValueError,
    `TOOL_REGENERATION`); `regenerate_turns: all` keeps them (`dflash.data.conversations`)."""
    if (settings.regenerate and settings.regenerate_turns != "all"
            and any(uses_tools(row) for row in rows if not is_token_row(row))):
        raise ValueError(TOOL_REGENERATION)


def regenerates(settings: DataSettings, rows: list[dict[str, Any]]) -> bool:
    """Whether the target answers `rows`' prompts: `data.regenerate`, except for token rows (trained as given);
    conversations with tool calls under it are refused (`check_tool_regeneration`)."""
    check_tool_regeneration(settings, rows)
    return settings.regenerate and not (rows and is_token_row(rows[0]))  # one shape per source


def _regenerate_turns(settings: DataSettings, part: str) -> int | str:
    """User turns answered per conversation: `data.regenerate_turns` for training, 1 for held-out rows
    (their first user turns are the speculative-evaluation prompts); "all" for both parts (whole conversations:
    the held-out prompts are the histories before their last replies)."""
    return settings.regenerate_turns if part == "train" or settings.regenerate_turns == "all" else 1


def asked_id(row: dict[str, Any], turns: int | str) -> str:
    """The cache key of what `row` asks the target with `turns` (`_regenerate_turns`): a whole conversation's
    `conversation_id`, else the `prompt_id` of its first `turns` user turns."""
    if turns == "all":
        return conversation_id(row["messages"], row.get("tools"))
    return prompt_id(prompt_turns(row["messages"], turns))


def _split_tag(settings: DataSettings) -> str:
    """Names the split's files: the source, its split, `limit` and `eval_size` decide which conversations
    land on each side."""
    return hashlib.sha1("|".join(str(v) for v in settings.held_out_split().values()).encode()).hexdigest()[:10]


def _regenerated_file(settings: DataSettings, root: Path, target_name: str, part: str, weights: str) -> Path:
    """The regenerated JSONL file of one part ("train" or "eval") under `root`, named by the target and its
    identity (`repliers.target_identity`: other weights behind the same name never reuse these replies), the
    split and the regeneration settings that change its rows."""
    tag = _split_tag(settings)
    safe_target = f"{cache_slug(target_name, 60, keep_end=True)}-w{weights}"
    turns = _regenerate_turns(settings, part)
    suffix = {1: "", "all": "-conversations"}.get(turns, f"-{turns}turns")  # none for one turn: old caches match
    if part == "train" and settings.standalone_turns != 1:
        suffix += f"-{settings.standalone_turns}standalone"
    return root / "regenerated" / f"{safe_target}-{tag}-{settings.regenerate_max_new_tokens}{suffix}-{part}.jsonl"


def _regenerate_part(rows: list[dict[str, Any]], settings: DataSettings, root: Path, replier: Replier, tokenizer: Any,
                     target_name: str, part: str, weights: str) -> Any:
    """Regenerate one part ("train" or "eval") of the split into its cached file, answered by `replier`. A run
    takes the replies already generated from the existing file of the same settings with the most turns below
    its own: `regenerate_turns` (2 turns from 1, 3 from 2 or else 1, ...), or `standalone_turns` for a
    standalone run (whose 1 is the first-turn file)."""
    turns = _regenerate_turns(settings, part)
    out = _regenerated_file(settings, root, target_name, part, weights)
    if turns == "all":
        return regenerate_conversations(rows, replier, tokenizer, out, target_name=target_name,
                                        batch_size=settings.regenerate_batch_size,
                                        max_new_tokens=settings.regenerate_max_new_tokens,
                                        max_prompt_tokens=settings.regenerate_max_prompt_tokens)
    key, count = (("standalone_turns", settings.standalone_turns) if part == "train" and settings.standalone_turns > 1
                  else ("regenerate_turns", turns))
    fewer = (_regenerated_file(replace(settings, **{key: k}), root, target_name, part, weights)
             for k in range(count - 1, 0, -1))
    earlier = next((path for path in fewer if path.exists()), None)
    return regenerate(rows, replier, tokenizer, out, batch_size=settings.regenerate_batch_size,
                      max_new_tokens=settings.regenerate_max_new_tokens,
                      max_prompt_tokens=settings.regenerate_max_prompt_tokens, turns=turns, target_name=target_name,
                      earlier=earlier)


def _identity(settings: DataSettings, target_name: str) -> TargetIdentity:
    """`target_identity`, logged once per run (a warning when a server's weights cannot be verified)."""
    identity = target_identity(settings, target_name)
    log.log(logging.INFO if identity.verified else logging.WARNING, "regeneration cache: %s",
            identity.describe(target_name, settings))
    return identity


def regenerate_source(config: Any) -> Any:
    """`dflash generate`: regenerate the training split of `config.data` with `config.target` (cached). Only the
    transformers engine loads the target's weights here; vLLM reads its folder, a server needs the tokenizer."""
    settings = config.data
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    identity = _identity(settings, config.target)
    model = None
    if settings.regenerate_engine == "transformers":
        model, tokenizer = load_target(config.target, dtype)
        model.to(device)
    else:
        tokenizer = load_tokenizer(config.target)
    root = Path(settings.cache_dir) if settings.cache_dir else cache_root()
    train, held, _, _ = split_conversations(settings)
    if not regenerates(replace(settings, regenerate=True), train + held):
        raise ValueError(f"data.source={settings.source} holds token rows (input_ids + loss_mask): they are trained as "
                         "given, there is nothing to regenerate")
    replier = make_replier(settings, config.target, tokenizer, identity, model=model, device=device, dtype=dtype)
    try:
        return _regenerate_part(_training_rows(train, held, settings), settings, root, replier, tokenizer, config.target,
                                "train", identity.fingerprint)
    finally:
        replier.close()


def _training_rows(train: list[dict[str, Any]], held: list[dict[str, Any]], settings: DataSettings) -> list[dict[str, Any]]:
    """The conversations whose prompts the target answers for training: `train` itself, or with
    `data.standalone_turns` N > 1, each of the first N user messages of every training conversation as a
    conversation of its own (its leading system turn kept). Those are single-turn prompts, like the
    speculative evaluation's, and many more of them (chat data has far more distinct user messages than
    distinct first turns); one equal to a held-out prompt is left out."""
    if settings.standalone_turns == 1:
        return train
    held_prompts = {first_prompt_id(c) for c in held}
    rows = []
    for index, conv in enumerate(train):
        turns = prompt_turns(conv["messages"], settings.standalone_turns)
        system = [m for m in turns if m["role"] == "system"]
        for k, user in enumerate(m for m in turns if m["role"] == "user"):
            row = {"id": f"{conv.get('id', index)}#{k}", "messages": [*system, user]}
            if first_prompt_id(row) not in held_prompts:
                rows.append(row)
    return rows


def _keep_rows_asked_for(path: Path, rows: list[dict[str, Any]], turns: int | str) -> int:
    """Rewrite the regenerated file `path` to the first row of each prompt that `rows` ask (with `turns`
    user turns each), and return how many rows it dropped. Regeneration appends to a cache and skips what
    is there, so a file can hold rows no longer asked for (one written before `split_held_out` dropped
    training conversations that open with a held-out prompt holds the very text the evaluation decodes)
    and, written before `cache_writer` locked it, the rows of two runs that regenerated it at once (every
    held-out prompt twice)."""
    asked = {asked_id(row, turns) for row in rows}
    with cache_writer(path):  # no run appends while this one rewrites
        lines = [line for line in path.read_bytes().splitlines(keepends=True) if line.strip()]
        kept, seen = [], set()
        for line in lines:
            pid = json.loads(line)["prompt_id"]
            if pid in asked and pid not in seen:
                kept.append(line)
            seen.add(pid)
        if len(kept) < len(lines):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(kept))
            tmp.replace(path)
            log.info("%s: dropped %d cached rows this run did not ask for or that repeat a prompt", path,
                     len(lines) - len(kept))
    return len(lines) - len(kept)


def prepare_corpus(settings: DataSettings, tokenizer: Any, target_model: Any, target_name: str) -> Corpus:
    """Train and held-out datasets for `settings` (both cached on disk between runs)."""
    root = Path(settings.cache_dir) if settings.cache_dir else cache_root()
    train, held, used, total = split_conversations(settings)
    paths: dict[str, Path] = {}
    dropped: dict[str, int] = {}
    regenerated = regenerates(settings, train + held)
    if settings.regenerate and not regenerated:
        log.warning("data.source=%s holds token rows (input_ids + loss_mask): they are trained as given, "
                    "data.regenerate does not apply to them", settings.source)
    # Once for both parts: the identity reads the weight files (or asks the server), and an engine started for the
    # training prompts answers the held-out ones too. A vLLM engine starts only if a prompt is not cached.
    identity = _identity(settings, target_name) if regenerated else None
    replier = make_replier(settings, target_name, tokenizer, identity, model=target_model) if identity else None
    try:
        for name, rows in {"train": train, "eval": held}.items():
            if not rows:
                continue
            if replier is not None:
                if name == "train":
                    rows = _training_rows(rows, held, settings)
                paths[name] = _regenerate_part(rows, settings, root, replier, tokenizer, target_name, name,
                                               identity.fingerprint).path
                dropped[name] = _keep_rows_asked_for(paths[name], rows, _regenerate_turns(settings, name))
            else:
                paths[name] = _write_jsonl(rows, root / "splits" / f"{_split_tag(settings)}-{name}.jsonl")
    finally:
        if replier is not None:
            replier.close()  # before training: a vLLM engine holds memory and processes
    datasets = {name: build_dataset(str(path), tokenizer, settings.max_length, cache_dir=root / "datasets")
                for name, path in paths.items()}
    description = {
        "source": settings.source,
        "conversations_available": total,
        "conversations_used": used,
        "train_conversations": len(train),
        "held_out_conversations": len(held),
        "regenerated": regenerated,
        "train_rows": len(datasets["train"]),
        "cached_rows_not_asked_for": dropped,
        "eval_rows": len(datasets["eval"]) if "eval" in datasets else 0,
        "files": {k: str(v) for k, v in paths.items()},
    }
    log.info("corpus: %s", description)
    if regenerated and settings.regenerate_turns == "all" and "eval" in paths:  # the target's own histories
        held = load_conversations(str(paths["eval"]))[0]
    return Corpus(datasets["train"], datasets.get("eval"), description, speculative_entries(held),
                  settings.held_out_split() if held else None)


def feature_corpus(root: str) -> Corpus:
    """The corpus of a run's offline feature folder (`dflash features`): its training part and, when the run
    held rows out, its held-out part, both `FeatureDataset`s. No held-out conversations: speculative
    decoding needs the target's trunk, which a run from features never loads; their split is recorded
    (`write_split_record`), so the export's `dflash eval` decodes them."""
    train_dir, held_out_dir = run_feature_parts(root)
    train = FeatureDataset(train_dir)
    held_out = FeatureDataset(held_out_dir) if held_out_dir is not None else None
    description = {"features": str(root), "train_rows": len(train), "eval_rows": len(held_out) if held_out else 0}
    log.info("corpus: %s", description)
    return Corpus(train, held_out, description, [], read_split_record(root))


def split_warning(train_rows: int, held_out_rows: int) -> str | None:
    """A warning when the held-out rows outnumber the training rows (a `data.limit` too small for
    `data.eval_size`), else None."""
    if held_out_rows > train_rows:
        return (f"{held_out_rows} held-out rows outnumber the {train_rows} training rows: data.limit is too small for "
                "data.eval_size (raise data.limit, or lower data.eval_size)")
    return None


def check_corpus(corpus: Corpus, mask_token_id: int, tokenizer: Any, *, warn: bool = True) -> None:
    """Refuse training rows that hold the draft's mask token (`check_token_absent`); warn (when `warn`: one
    rank) when the held-out rows outnumber the training rows."""
    if warn and corpus.eval is not None and (warning := split_warning(len(corpus.train), len(corpus.eval))):
        log.warning(warning)
    check_token_absent(corpus.train, mask_token_id, tokenizer)


def training_data(dataset: Any, settings: DataSettings, tokenizer: Any, target_model: Any, target_name: str, *,
                  rank: int = 0, world_size: int = 1) -> Corpus:
    """What a run trains and evaluates on: the configured recipe (`prepare_corpus`) when `dataset` is
    None; else the user's data: a (train, held-out) pair of tokenized datasets, tokenized rows
    (`input_ids` / `loss_mask`), or conversations to tokenize (no held-out split then). With `data.features`
    the rows of that feature folder (`feature_corpus`)."""
    if settings.features:
        if dataset is not None:
            raise ValueError("data.features trains on the rows of its feature folder: pass no dataset, or set "
                             "data.features=null to train on this one")
        return feature_corpus(settings.features)
    if dataset is None:
        if world_size > 1 and rank != 0:
            dist.barrier()  # rank 0 regenerates and tokenizes first; the others then read its caches
        corpus = prepare_corpus(settings, tokenizer, target_model, target_name)
        if world_size > 1 and rank == 0:
            dist.barrier()
        return corpus
    if isinstance(dataset, tuple):
        return Corpus(*dataset, description={}, held_out_conversations=[])
    if "input_ids" in (getattr(dataset, "column_names", None) or []):
        return Corpus(dataset, None, description={}, held_out_conversations=[])
    rows = build_dataset(dataset, tokenizer, settings.max_length)
    return Corpus(rows, None, description={}, held_out_conversations=[])
