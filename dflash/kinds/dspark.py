"""DSpark (DeepSeek, 2026): the DFlash backbone plus a low-rank Markov head and a confidence head.

Layout (anchor-as-first-prediction, vLLM's `sample_from_anchor: true`): the block anchored at a holds
the token at a in slot 0 and the mask token in slots 1..bs-1, like DFlash's, but **slot k predicts the
token at a + k + 1** for k = 0..bs-1: bs input slots give bs proposals, slot 0 included (DFlash's slot k
predicts a + k and slot 0 none). Labels, weights and the objective: `dflash.kinds.dspark_objective`.

Two heads, with the published parameter names (DeepSpec's `Qwen3DSparkModel`, the export contract):

* `markov_head` (vanilla): `markov_w1` an Embedding `[V, r]` and `markov_w2` a Linear r -> V without bias
  (weight `[V, r]`). The logits of slot k are z_k = W_lm h_k + W2 W1[x_{k-1}], x_{k-1} the token before
  the one slot k predicts (the slot-0 token for k = 0). No norm, no activation, its own table (not the
  target's embedding). Training reads the data token there (teacher forcing), decoding its own draft.
* `confidence_head.proj`: a Linear (H + r) -> 1 with bias over [h_k ; W1[x_{k-1}]] (H -> 1 with
  `confidence_head_with_markov: false`): c_k = sigmoid(proj) estimates the probability that the target
  accepts slot k's draft. It never changes a drafted token.

Init N(0, 0.02) for every weight of both heads, biases 0 (HF Qwen3 `_init_weights`, as DeepSpec).
Decoding (`dspark_propose`): one parallel backbone forward over the block, then the Markov walk
d_k = argmax z_k(d_{k-1}) over all bs slots, one r x V product per slot, the backbone is not re-run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash.kinds.heads import HeadKeys
from dflash.losses import head_logits
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel

ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's class; SGLang's EntryClass and vLLM's registry name for it
# DeepSpec's export also holds copies of the target's embedding and LM head (its own evaluator loads them);
# SGLang skips these names and vLLM shares the target's when they are absent.
TARGET_COPY_NAMES = ("embed_tokens.weight", "lm_head.weight")
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and rnn heads are not implemented


@dataclass(frozen=True)
class DSparkHeadConfig(HeadKeys):
    """The DSpark keys of a draft config (published names; they sit at the top level of DeepSpec's config.json,
    where SGLang and vLLM read them). Their presence marks a DSpark draft."""

    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool

    @classmethod
    def from_draft_config(cls, cfg: DFlashDraftConfig) -> DSparkHeadConfig:
        """Parse and check `cfg.extra` (a config built here, or read back from an export)."""
        missing = [name for name in HEAD_KEYS if name not in cfg.extra]
        if missing:
            raise ValueError(f"DSpark draft config lacks {missing} (top-level keys of a DSpark config.json)")
        x = cfg.extra
        head = cls(int(x["markov_rank"]), str(x["markov_head_type"]), bool(x["enable_confidence_head"]),
                   bool(x["confidence_head_with_markov"]))
        if head.markov_rank < 1:
            raise ValueError(f"invalid DSpark draft config: markov_rank {head.markov_rank} must be >= 1")
        if head.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"DSpark markov_head_type {head.markov_head_type!r} is not implemented: only vanilla is "
                             "(DeepSpec's gated and rnn heads are not); train or load a vanilla-head draft")
        return head


HEAD_KEYS = tuple(f.name for f in dataclasses.fields(DSparkHeadConfig))
# Anchors per sequence the draft was trained with (`draft.num_anchors`, put into the draft config by the factory):
# DeepSpec's `Qwen3DSparkModel.__init__` asserts `config.num_anchors` (deepspec/modeling/dspark/qwen3/modeling.py
# @5905deb7, its training forward samples that many), so its loader refuses an export without it. Top level too.
TRAINING_KEYS = ("num_anchors",)
TOP_LEVEL_KEYS = HEAD_KEYS + TRAINING_KEYS  # the DSpark keys of a config.json's top level, never in dflash_config


def is_dspark(cfg: DFlashDraftConfig) -> bool:
    """Whether a draft config describes a DSpark draft (its head keys are present)."""
    return any(name in cfg.extra for name in HEAD_KEYS)


def dspark_weight_names(head: DSparkHeadConfig) -> set[str]:
    """The tensor names DSpark adds to a DFlash draft (export contract; the target copies are optional)."""
    names = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    return names | ({"confidence_head.proj.weight", "confidence_head.proj.bias"} if head.enable_confidence_head else set())


def dspark_config_fields(cfg: DFlashDraftConfig) -> dict[str, Any]:
    """The top-level keys of a DSpark config.json beyond the DFlash ones (DeepSpec's `build_draft_config`): the
    head keys, the layout flag (speculators read `sample_from_anchor`; vLLM's qwen3_dspark.py @47bd6d7c reads
    `dspark_bonus_anchor` instead, absent here: the same layout), and the mask token / layer ids at the top
    level as DeepSpec writes them, with `num_anchors` when the config carries it (`TRAINING_KEYS`)."""
    return {**DSparkHeadConfig.from_draft_config(cfg).to_extra(), "sample_from_anchor": True,
            "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
            **{k: cfg.extra[k] for k in TRAINING_KEYS if k in cfg.extra}}


def dspark_extra_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The DSpark keys of a config.json dict (top level: `TOP_LEVEL_KEYS`), or {} when it is not a DSpark config. Refuses the
    other layout (speculators' `sample_from_anchor: false`: slot j predicts a + j), which this model cannot run."""
    if ARCHITECTURE not in (data.get("architectures") or []) and "markov_rank" not in data:
        return {}
    if data.get("sample_from_anchor", True) is not True or data.get("speculators_model_type") == "dspark":
        raise ValueError("this DSpark config uses the slot-j-predicts-a+j layout (sample_from_anchor false / speculators); "
                         "dflash's DSpark drafts predict a + k + 1 from slot k (DeepSpec's layout) only")
    return {name: data[name] for name in TOP_LEVEL_KEYS if name in data}


class MarkovHead(nn.Module):
    """The vanilla Markov head: the bias W2 W1[x] `[..., V]` on the logits of the slot after token x `[...]`."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.normal_(self.markov_w2.weight, std=0.02)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    """The acceptance-probability logit of a slot from its state h `[..., H]` and W1[previous token] `[..., r]`."""

    def __init__(self, hidden: int, rank: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + (rank if with_markov else 0), 1)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[...]` (sigmoid: the confidence)."""
        x = torch.cat([hidden, markov.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(x).squeeze(-1).float()


class DSparkDraftModel(DFlashDraftModel):
    """DFlash backbone plus the Markov and confidence heads. `forward` is the backbone's (final-normed hidden
    states `[B, Q, H]`); the heads are read by the objective and by `dspark_propose`."""

    def __init__(self, cfg: DFlashDraftConfig) -> None:
        self.head_config = DSparkHeadConfig.from_draft_config(cfg)  # refuse a bad config before building
        super().__init__(cfg)
        head = self.head_config
        self.markov_head = MarkovHead(cfg.vocab_size, head.markov_rank)
        self.confidence_head = (ConfidenceHead(cfg.hidden_size, head.markov_rank, head.confidence_head_with_markov)
                                if head.enable_confidence_head else None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The backbone's rule, then the heads' own (it would set the confidence bias to 1 like a norm weight)."""
        super().reset_parameters()
        for name in ("markov_head", "confidence_head"):
            if self._modules.get(name) is not None:  # built after the backbone: their own init ran then
                self._modules[name].reset_parameters()


# ---- speculative decoding ------------------------------------------------------------------------


@torch.no_grad()
def dspark_propose(draft: DSparkDraftModel, hidden: torch.Tensor, first_token: torch.Tensor,
                   head_weight: torch.Tensor) -> torch.Tensor:
    """Greedy DSpark drafts `[B, bs]` of one block: the Markov walk over every slot.

    Args:
        hidden: `[B, bs, H]` final-normed draft states of the block; first_token: `[B, 1]` its slot-0 token.
        head_weight: `[V, H]` the target's LM head.
    d_k = argmax(W_lm h_k + W2 W1[d_{k-1}]) for k = 0..bs-1, d_{-1} = the slot-0 token: what training scores
    with the teacher-forced previous token. Slot k's draft is the proposal for position start + k + 1.
    """
    unary = head_logits(hidden, head_weight).float()  # [B, bs, V]
    token, drafts = first_token[:, 0], []
    for k in range(hidden.shape[1]):
        token = (unary[:, k] + draft.markov_head(token).float()).argmax(dim=-1)
        drafts.append(token)
    return torch.stack(drafts, dim=1)
