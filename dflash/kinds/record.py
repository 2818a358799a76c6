"""The record of one draft kind (`DraftKind`): everything the rest of dflash needs to know about a kind,
declared in one place so that nothing outside `dflash/kinds/` branches on a kind's name, model class or
config keys (tests/test_kinds.py keeps it so).

A kind is found from what a caller holds, never worked out by hand:

    kind_named(config.draft.kind)      a run's configuration
    kind_of(draft.config)              a draft, or a draft config read back from a checkpoint or an export
    kind_of_export(config)             an export's config.json (a dict), before any draft config is made of it

The registry (`dflash.kinds.registry.KINDS`) lists the records; its module doc says what adding a kind touches.
The record holds no run state: its callables are pure functions of the settings they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.objective import DFlashObjective

Check = tuple[bool, str]  # (holds, the message naming the key and its range)


def _no_keys(settings: Any, draft: Any) -> dict[str, Any]:
    return {}


def _no_options(settings: Any) -> dict[str, Any]:
    return {}


def _no_checks(settings: Any, draft: Any) -> list[Check]:
    return []


@dataclass(frozen=True)
class Unsupported:
    """What a kind cannot do, each as the reason said to the user after "draft.kind: NAME does not support ..."
    (None: supported). Refused before any weight is read."""

    offline_features: str | None = None  # data.features (a run without the target's trunk)
    hf_trainer: str | None = None  # the transformers.Trainer path (dflash.hf)
    dpace: str | None = None  # draft.position_weights: dpace
    loss_decay_gamma: str | None = None  # draft.loss_decay_gamma other than auto (the kind decays its own way)


VLLM, SGLANG, DEEPSPEC = "vllm", "sglang", "deepspec"  # who reads an export (DeepSpec: DSpark's reference code, not an engine)


@dataclass(frozen=True)
class ServingField:
    """One config.json field an engine's loader reads: `path` (dotted), its JSON type, the meaning the engines give
    it, the value rule (`ok(value, config)`, described by `expect`), which engines read it (`read_by`), and whether an
    export may leave it out (`optional`: checked only when present). Every export's are
    `dflash.evaluation.serving.SERVING_FIELDS`; a kind declares its own (`Serving.fields`)."""

    path: str
    kind: type | tuple[type, ...]
    meaning: str
    expect: str = "positive"
    ok: Callable[[Any, dict[str, Any]], bool] | None = lambda v, c: v > 0
    read_by: tuple[str, ...] = (VLLM, SGLANG)
    optional: bool = False


@dataclass(frozen=True)
class ExportLayout:
    """How a kind's drafts are laid out in the published format (config.json and model.safetensors): what
    `dflash.evaluation.export` writes and reads back. `config` is an export's config.json as a dict, `cfg` a
    `DFlashDraftConfig`."""

    # Its config.json `architectures` entry.
    architecture: str = "DFlashDraftModel"
    # Whether an export's config.json is of this kind: its architecture, or its head keys under another one (so a
    # wrong architecture is reported against the kind the keys say). Asked like `DraftKind.recognises`
    # (`registry.kind_of_export`).
    recognises: Callable[[dict[str, Any]], bool] = lambda config: True
    # The tensor names its drafts add to the DFlash backbone's (`export.draft_weight_names`).
    weight_names: Callable[[DFlashDraftConfig], set[str]] = lambda cfg: set()
    # Copies of the target's embedding and LM head (in that order) an export may hold beside the draft's weights
    # (DSpark: DeepSpec's layout); (): none, an export holds the draft's own weights only.
    target_copies: tuple[str, ...] = ()
    # Top-level config.json keys it writes beside the Qwen3 and DFlash ones.
    config_fields: Callable[[DFlashDraftConfig], dict[str, Any]] = lambda cfg: {}
    # Its `extra` keys that are written at the top level (by `config_fields`) and not under `dflash_config`.
    top_level_keys: tuple[str, ...] = ()
    # Whether `dflash_config.block_size` is written too (its readers take the block size from there first).
    nested_block_size: bool = False
    # Its `extra` keys read back from an export's top level ({} when there are none; a ValueError for a layout its
    # model cannot run).
    extra_from_config: Callable[[dict[str, Any]], dict[str, Any]] = lambda config: {}
    # `draft` settings its `DraftKind.draft_keys` record, which a checkpoint from before they were recorded takes
    # from its run's config.yaml on export.
    run_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Serving:
    """What the engines make of a kind's export: the commands, the checks and the notes of
    `dflash.evaluation.serving` and `engine_eval` (`config`: an export's config.json as a dict). The engine facts
    are cited in the kind's module."""

    # What the engines make of its `ExportLayout.architecture` (the serving check's meaning of the field).
    architecture_meaning: str = ("model class: vLLM's registry maps DFlashDraftModel to qwen3_dflash.DFlashQwen3ForCausalLM; "
                                 "SGLang's EntryClass of models/dflash.py")
    # vLLM's speculative `method`, SGLang's `--speculative-algorithm` and the extra SGLang flags its drafts need.
    vllm_method: str = "dflash"
    sglang_algorithm: str = "DFLASH"
    sglang_flags: tuple[str, ...] = ()
    # Why vLLM cannot serve it at all (no vLLM command; None: it can), and what vLLM's V1 model runner (the CPU one)
    # says refusing it (None: vLLM serves it on a CPU too).
    vllm_unservable: str | None = None
    vllm_cpu_refusal: str | None = None
    # The engine source its serving facts were checked against, where not the DFlash one (`serving.ENGINES`).
    vllm_source: str | None = None
    sglang_source: str | None = None
    # The config.json fields the engines read for it beyond every export's (`serving.serving_fields`).
    fields: tuple[ServingField, ...] = ()
    # Tensor -> (the shape the engines build it with from config.json, from what), for its tensors they load without
    # checking that the file has them (a KeyError / TypeError for a broken field).
    built_shapes: Callable[[dict[str, Any]], dict[str, tuple[tuple[int, ...], str]]] = lambda config: {}
    # What an export's tensor names hold of its head when config.json does not say it (an export of another kind):
    # the problem, worded after "model.safetensors holds"; None: nothing.
    stray_weights: Callable[[dict[str, Any], set[str]], str | None] = lambda config, names: None
    # The notes `dflash export` prints under its serving commands.
    notes: Callable[[dict[str, Any]], list[str]] = lambda config: []
    # Whether `dflash export`'s "Serve it" line names the kind ("; a DSpark draft").
    titled: bool = False


@dataclass(frozen=True)
class DraftKind:
    """One draft kind. `draft` below is the run's `DraftSettings` (`config.draft`), `settings` the kind's own
    section (`config.<name>`, an instance of `settings_type`; None for a kind without one)."""

    name: str  # `draft.kind`, and the name of its config section when it has one
    title: str  # how messages and docs name it ("DFlash 2")
    model: type[DFlashDraftModel]
    objective: type[DFlashObjective]
    # The kind's `TrainConfig` section (a dataclass of its keys, `config.<name>`); None: it has none.
    settings_type: type | None = None
    # Whether a draft config (built here, or read back from a checkpoint or an export) is of this kind: the keys
    # this kind adds to `DFlashDraftConfig.extra` mark it. The plain DFlash record recognises every config and is
    # asked last (`registry.kind_of`).
    recognises: Callable[[DFlashDraftConfig], bool] = lambda cfg: True
    # The keys this kind adds to a draft config's `extra` (its head's published keys), from its settings.
    draft_keys: Callable[[Any, Any], dict[str, Any]] = _no_keys
    # Its objective's own keyword arguments (beside the common ones `factory.objective_for` passes), from its
    # settings; they override a common one of the same name (DSpark's own loss decay `gamma`).
    objective_options: Callable[[Any], dict[str, Any]] = _no_options
    # Range checks of its settings (run by `TrainConfig.validate` for every kind: a bad value is an error even
    # when another kind trains, as for any other key).
    checks: Callable[[Any, Any], list[Check]] = _no_checks
    unsupported: Unsupported = field(default_factory=Unsupported)
    # The block size its published drafts use, taken when `draft.block_size` is not given (None: the default).
    published_block_size: int | None = None
    # The position decay `dflash train --dry-run` describes, when the kind decays its own way (None: the
    # draft section's gamma).
    describe_decay: Callable[[Any], str] | None = None
    export: ExportLayout = field(default_factory=ExportLayout)  # its published format
    serving: Serving = field(default_factory=Serving)  # what the engines make of it

    @property
    def section(self) -> str | None:
        """The config section of this kind's own keys (`domino`, ...), None when it has none."""
        return self.name if self.settings_type is not None else None

    def refusals(self, draft: Any, data: Any) -> list[str]:
        """What this kind cannot do among the run's settings (`draft`: `config.draft`, `data`: `config.data`):
        one message each, the reason then the fix."""
        no, u = f"draft.kind: {self.name} does not support", self.unsupported
        return [f"{no} {what}: {why}" for wanted, what, why in [
            (bool(data.features), "offline features (data.features)", u.offline_features),
            (draft.position_weights == "dpace", "draft.position_weights: dpace", u.dpace),
            (draft.loss_decay_gamma != "auto", "draft.loss_decay_gamma", u.loss_decay_gamma),
        ] if wanted and why is not None]

    def proposals_per_block(self, block_size: int) -> int:
        """Draft tokens one block of `block_size` slots proposes: its model class's rule (the engines' counts are
        worked out from config.json, without a draft)."""
        return self.model.proposals_per_block(block_size)
