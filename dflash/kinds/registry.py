"""The draft kinds dflash trains, one `DraftKind` record each, and the ways to find one.

Adding a fifth kind touches four files: its module in `dflash/kinds/` (draft model with its proposal rule,
objective with its metric layout, settings dataclass), its record here (appended to `KINDS`), its settings
section as a field of `dflash.config.TrainConfig`, and its tests. Nothing else names a kind
(tests/test_kinds.py fails on a kind branch anywhere else in the package).
"""

from __future__ import annotations

from typing import Any

from dflash.kinds import dflash2, domino, dspark  # their export and serving facts (`ExportLayout`, `Serving`)
from dflash.kinds.dflash2 import DFlash2DraftModel, DFlash2HeadConfig, DFlash2Settings, is_dflash2
from dflash.kinds.dflash2_objective import DFlash2Objective
from dflash.kinds.domino import DominoDraftModel, DominoHeadConfig, DominoObjective, DominoSettings, is_domino
from dflash.kinds.dspark import DSparkDraftModel, DSparkHeadConfig, DSparkSettings, is_dspark
from dflash.kinds.dspark_objective import DSparkObjective
from dflash.kinds.record import Check, DraftKind, ExportLayout, Serving, Unsupported
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.objective import DFlashObjective


def _domino_checks(d: DominoSettings, draft: Any) -> list[Check]:
    return [(d.emb_dim >= 1 and d.gru_hidden_dim >= 1, "domino.emb_dim/gru_hidden_dim must be >= 1"),
            (0 <= d.pure_draft_prefix_len < draft.block_size - 1, "domino.pure_draft_prefix_len must be in [0, block_size - 1)"),
            (0 <= d.lambda_start <= 1, "domino.lambda_start must be in [0, 1]"),
            (0 < d.decay_ratio <= 1, "domino.decay_ratio must be in (0, 1]"),
            (0 <= d.scheduled_sampling <= 1, "domino.scheduled_sampling must be in [0, 1]")]


def _dflash2_checks(d: DFlash2Settings, draft: Any) -> list[Check]:
    """The hidden size's divisibility by conv_group_size and top_k <= vocab are checked when the draft is built
    (`DFlash2HeadConfig.from_draft_config`): they need the target's config."""
    return [(1 <= d.conv_kernel_size <= draft.block_size, "dflash2.conv_kernel_size must be in [1, block_size]"),
            (d.conv_group_size >= 1 and d.selector_rank >= 1, "dflash2.conv_group_size/selector_rank must be >= 1"),
            (d.selector_top_k >= 1, "dflash2.selector_top_k must be >= 1"),
            (d.selector_alpha >= 0, "dflash2.selector_alpha must be >= 0")]


def _dspark_checks(d: DSparkSettings, draft: Any) -> list[Check]:
    return [(d.markov_rank >= 1, "dspark.markov_rank must be >= 1"),
            (d.markov_head_type == "vanilla", f"dspark.markov_head_type {d.markov_head_type!r} is not implemented (only "
             "vanilla, the paper's default, is; not DeepSpec's gated / rnn heads): set dspark.markov_head_type=vanilla"),
            (d.loss_decay_gamma is None or d.loss_decay_gamma > 0, "dspark.loss_decay_gamma must be > 0 or null (off)"),
            (min(d.ce_alpha, d.l1_alpha, d.confidence_alpha) >= 0, "dspark.ce_alpha/l1_alpha/confidence_alpha must be >= 0"),
            (d.ce_alpha + d.l1_alpha > 0, "dspark.ce_alpha + dspark.l1_alpha must be > 0: otherwise nothing trains the drafts")]


DFLASH = DraftKind(name="dflash", title="DFlash", model=DFlashDraftModel, objective=DFlashObjective)

DOMINO = DraftKind(
    name="domino", title="Domino", model=DominoDraftModel, objective=DominoObjective, settings_type=DominoSettings,
    recognises=is_domino,
    draft_keys=lambda d, draft: DominoHeadConfig.from_settings(d).to_extra(),
    objective_options=lambda d: {"lambda_start": d.lambda_start, "decay_ratio": d.decay_ratio,
                                 "scheduled_sampling": d.scheduled_sampling},
    checks=_domino_checks,
    unsupported=Unsupported(dpace="it is for DFlash drafts (a Domino draft's mixed loss takes decay or none); add "
                                  "draft.kind=dflash (the embedded default trains a Domino draft on a GPU)"),
    # DFlash's architecture and counts; SGLang only, with the head
    export=ExportLayout(recognises=domino.is_domino_export, weight_names=lambda cfg: set(domino.DOMINO_WEIGHT_NAMES)),
    serving=Serving(sglang_flags=domino.SGLANG_FLAGS, vllm_unservable=domino.VLLM_DOMINO, vllm_source=domino.VLLM_SOURCE,
                    fields=domino.SERVING_FIELDS, stray_weights=domino.domino_stray_head,
                    notes=lambda config: list(domino.SERVING_NOTES)),
)

DFLASH2 = DraftKind(
    name="dflash2", title="DFlash 2", model=DFlash2DraftModel, objective=DFlash2Objective,
    settings_type=DFlash2Settings, recognises=is_dflash2,
    draft_keys=lambda d, draft: DFlash2HeadConfig.from_settings(d).to_extra(),
    objective_options=lambda d: {"selector_alpha": d.selector_alpha, "selector_gold": d.selector_gold},
    checks=_dflash2_checks,
    unsupported=Unsupported(
        dpace="it is not implemented for DFlash 2 drafts (the selector loss takes the planned position weights): "
              "use decay or none, or add draft.kind=dflash (the embedded default trains a DFlash 2 draft on a CPU)",
        hf_trainer="it is supported by `dflash train` / DFlashTrainer, not yet by the transformers.Trainer path "
                   "(untested there): train it with `dflash train draft.kind=dflash2`, or set draft.kind=dflash or "
                   "domino here (the embedded default trains a DFlash 2 draft on a CPU)"),
    published_block_size=8,  # z-lab's and SpecForge's Qwen DFlash 2 drafts
    # its own architecture on the engines' DFlash path, with the DFlash counts
    export=ExportLayout(architecture=dflash2.ARCHITECTURE, recognises=dflash2.is_dflash2_export,
                        weight_names=lambda cfg: dflash2.dflash2_weight_names(cfg.num_hidden_layers),
                        config_fields=dflash2.dflash2_export_fields,
                        nested_block_size=True),  # its readers take its conv block from there
    serving=Serving(architecture_meaning=dflash2.ARCHITECTURE_MEANING, vllm_cpu_refusal=dflash2.VLLM_CPU_REFUSAL,
                    vllm_source=dflash2.VLLM_SOURCE, sglang_source=dflash2.SGLANG_SOURCE, fields=dflash2.SERVING_FIELDS,
                    built_shapes=dflash2.dflash2_built_shapes, notes=lambda config: list(dflash2.SERVING_NOTES),
                    titled=True),
)

DSPARK = DraftKind(
    name="dspark", title="DSpark", model=DSparkDraftModel, objective=DSparkObjective, settings_type=DSparkSettings,
    recognises=is_dspark,
    # with the anchors per sequence DeepSpec's loader asserts (`dspark.TRAINING_KEYS`)
    draft_keys=lambda d, draft: {**DSparkHeadConfig.from_settings(d).to_extra(), "num_anchors": draft.num_anchors},
    objective_options=lambda d: {"ce_alpha": d.ce_alpha, "l1_alpha": d.l1_alpha,
                                 "confidence_alpha": d.confidence_alpha, "gamma": d.loss_decay_gamma},
    checks=_dspark_checks,
    unsupported=Unsupported(
        offline_features="its L1 term reads the target's final-norm last hidden state, which feature files do not "
                         "hold; run the target online (data.features=null)",
        dpace="it is not implemented for its three-term loss: use decay or none",
        loss_decay_gamma="it decays its loss by dspark.loss_decay_gamma (exp(-k / gamma), slot 0 included): leave "
                         "draft.loss_decay_gamma at auto and set dspark.loss_decay_gamma",
        hf_trainer="it is supported by `dflash train` / DFlashTrainer, not yet by the transformers.Trainer path "
                   "(untested there): train it with `dflash train draft.kind=dspark`, or set draft.kind=dflash or "
                   "domino here"),
    published_block_size=7,  # DeepSpec's DSpark drafts
    describe_decay=lambda d: f"decay exp(-k / {d.loss_decay_gamma}), slot 0 included",
    # DeepSpec's Qwen3DSparkModel shape (head keys at the top level), its own engine method
    export=ExportLayout(architecture=dspark.ARCHITECTURE, recognises=dspark.is_dspark_export,
                        weight_names=lambda cfg: dspark.dspark_weight_names(DSparkHeadConfig.from_draft_config(cfg)),
                        target_copies=dspark.TARGET_COPY_NAMES, config_fields=dspark.dspark_config_fields,
                        top_level_keys=dspark.TOP_LEVEL_KEYS,
                        nested_block_size=True,  # SGLang's DFlash parser reads dflash_config first
                        extra_from_config=dspark.dspark_extra_from_json, run_keys=dspark.TRAINING_KEYS),
    serving=Serving(architecture_meaning=dspark.ARCHITECTURE_MEANING, vllm_method="dspark", sglang_algorithm="DSPARK",
                    vllm_cpu_refusal=dspark.VLLM_CPU_REFUSAL, vllm_source=dspark.VLLM_SOURCE,
                    sglang_source=dspark.SGLANG_SOURCE, fields=dspark.SERVING_FIELDS,
                    built_shapes=dspark.dspark_built_shapes, notes=dspark.dspark_serving_notes, titled=True),
)

KINDS: tuple[DraftKind, ...] = (DFLASH, DOMINO, DFLASH2, DSPARK)
KIND_NAMES = tuple(k.name for k in KINDS)


def kind_named(name: str) -> DraftKind:
    """The record of `draft.kind` `name`; a ValueError listing the kinds for another name."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"draft.kind {name!r} is not a draft kind: use one of {', '.join(KIND_NAMES)}")


def kind_of(cfg: DFlashDraftConfig) -> DraftKind:
    """The kind of a draft config (built here, or read back from a checkpoint or an export): the first record
    past plain DFlash whose keys it holds, else DFlash."""
    return next((kind for kind in KINDS[1:] if kind.recognises(cfg)), DFLASH)


def kind_of_export(config: dict[str, Any]) -> DraftKind:
    """The kind of an export's config.json (a dict): the first record past plain DFlash that recognises it
    (`ExportLayout.recognises`: by its architecture, or its head keys under another one), else DFlash."""
    return next((kind for kind in KINDS[1:] if kind.export.recognises(config)), DFLASH)


def draft_model_for_config(cfg: DFlashDraftConfig) -> DFlashDraftModel:
    """A fresh draft of the kind `cfg` describes (`kind_of`)."""
    return kind_of(cfg).model(cfg)
