"""The settings of the draft kinds beyond DFlash (`domino.*`, `dflash2.*`, `dspark.*` keys of `TrainConfig`).

Plain dataclasses, imported by `dflash.config`; each field's comment is its meaning in `dflash config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SelectorGold = Literal["strict", "insert"]  # DFlash 2: the selector loss where the gold token is not a candidate

# The `TrainConfig` sections of the kinds, each named like the `draft.kind` that alone reads it (`dflash.factory`):
# a key of another kind's section set by the user is refused (`dflash.config_checks.other_kind_error`).
KIND_SECTIONS = ("domino", "dflash2", "dspark")


@dataclass
class DominoSettings:
    """Domino correction head (used when `draft.kind: domino`); names follow the published config."""

    emb_dim: int = 256  # low-rank width of [backbone hidden || GRU state] -> emb_dim -> SiLU -> vocab
    gru_hidden_dim: int = 1024
    pure_draft_prefix_len: int = 1  # slots before suffix_start get no correction
    shift_label: bool = False  # label layout of the published checkpoints (see dflash.kinds.domino)
    lambda_start: float = 1.0  # weight of the base CE at step 0; falls linearly to 0
    decay_ratio: float = 0.5  # ... over decay_ratio * max_steps
    scheduled_sampling: float = 0.0  # fraction of GRU inputs taken from the draft's own base predictions


@dataclass
class DFlash2Settings:
    """DFlash 2 convolutions and candidate selector (used when `draft.kind: dflash2`); published key names."""

    conv_kernel_size: int = 2  # taps of the dynamic causal conv over the block positions
    conv_group_size: int = 16  # channels that share one dynamic coefficient (the hidden size must divide by it)
    selector_rank: int = 256  # rank of the selector's bilinear predecessor/successor score
    selector_top_k: int = 16  # candidates the selector ranks at each slot (top-K of the draft's logits)
    selector_alpha: float = 1.0  # weight of the selector loss next to the unary CE
    # Selector loss where the gold token is not among the top-K: strict (none, SpecForge) or insert (the
    # weakest candidate replaced by the gold, vLLM speculators #1006; for the loss only)
    selector_gold: SelectorGold = "strict"


@dataclass
class DSparkSettings:
    """DSpark Markov and confidence heads and loss (`draft.kind: dspark`; what it refuses: `factory.check_dspark_support`)."""

    markov_rank: int = 256  # rank r of the Markov head: logits + W2 W1[previous token], W1 and W2 [vocab, r]
    markov_head_type: str = "vanilla"  # only vanilla is implemented (DeepSpec's gated and rnn heads are refused)
    enable_confidence_head: bool = True  # train the acceptance-probability head (it never changes the drafted tokens)
    confidence_head_with_markov: bool = True  # the confidence head reads [h; W1[previous token]] (false: h only)
    loss_decay_gamma: float | None = 4.0  # position decay exp(-k / gamma) of slot k = 0..bs-1 (null: none)
    ce_alpha: float = 0.1  # weight of the CE against the data token
    l1_alpha: float = 0.9  # weight of ||p_draft - p_target||_1 over the full vocabulary at T = 1 (twice the TV)
    confidence_alpha: float = 1.0  # weight of the confidence head's BCE against the soft acceptance 1 - L1 / 2
