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
from dflash.kinds.record import DEEPSPEC, SGLANG, VLLM, ServingField
from dflash.losses import head_logits
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel

ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's class; SGLang's EntryClass and vLLM's registry name for it
# DeepSpec's export also holds copies of the target's embedding and LM head (its own evaluator loads them);
# SGLang skips these names and vLLM shares the target's when they are absent.
TARGET_COPY_NAMES = ("embed_tokens.weight", "lm_head.weight")
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and rnn heads are not implemented


@dataclass
class DSparkSettings:
    """DSpark Markov and confidence heads and loss (`draft.kind: dspark`; what it refuses: `factory.check_kind_support`)."""

    markov_rank: int = 256  # rank r of the Markov head: logits + W2 W1[previous token], W1 and W2 [vocab, r]
    markov_head_type: str = "vanilla"  # only vanilla is implemented (DeepSpec's gated and rnn heads are refused)
    enable_confidence_head: bool = True  # train the acceptance-probability head (it never changes the drafted tokens)
    confidence_head_with_markov: bool = True  # the confidence head reads [h; W1[previous token]] (false: h only)
    loss_decay_gamma: float | None = 4.0  # position decay exp(-k / gamma) of slot k = 0..bs-1 (null: none)
    ce_alpha: float = 0.1  # weight of the CE against the data token
    l1_alpha: float = 0.9  # weight of ||p_draft - p_target||_1 over the full vocabulary at T = 1 (twice the TV)
    confidence_alpha: float = 1.0  # weight of the confidence head's BCE against the soft acceptance 1 - L1 / 2


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
    if not is_dspark_export(data):
        return {}
    if data.get("sample_from_anchor", True) is not True or data.get("speculators_model_type") == "dspark":
        raise ValueError("this DSpark config uses the slot-j-predicts-a+j layout (sample_from_anchor false / speculators); "
                         "dflash's DSpark drafts predict a + k + 1 from slot k (DeepSpec's layout) only")
    return {name: data[name] for name in TOP_LEVEL_KEYS if name in data}


# ---- export and serving (the facts of `registry.DSPARK`, read by dflash.evaluation.serving / engine_eval) ----------

# DSpark has its own method (vLLM `"method": "dspark"`, SGLang `DSPARK`) and every slot proposes: vLLM queries
# num_speculative_tokens = block_size slots (the anchor, then masks, each predicting the next token), SGLang verifies
# gamma + 1 = block_size + 1 tokens. Read from vLLM @47bd6d7c model_executor/models/qwen3_dspark.py,
# v1/worker/gpu/spec_decode/dspark/speculator.py, .../dflash/speculator.py, .../spec_decode/utils.py,
# config/speculative.py (eagle3_utils.py @0cfdd2e1); SGLang @37e23874 srt/models/dspark.py,
# speculative/dspark_components/dspark_config.py @01f47623, arg_groups/speculative_hook.py @004c82e0,
# speculative/dflash_utils.py @00731f0b.
ARCHITECTURE_MEANING = ("model class: vLLM's registry maps it to qwen3_dspark.Qwen3DSparkForCausalLM (and guesses "
                        "method dspark from it); SGLang's EntryClass of models/dspark.py")
VLLM_SOURCE = "vllm-project/vllm @47bd6d7c: qwen3_dspark.py, dspark/speculator.py, config/speculative.py"
SGLANG_SOURCE = "sgl-project/sglang @37e23874: models/dspark.py; dspark_config.py @01f47623, speculative_hook.py @004c82e0"
VLLM_CPU_REFUSAL = '"dspark speculative decoding"'  # vLLM 0.32's V1 model runner (the CPU one) refusing it
SERVING_FIELDS = (
    ServingField("markov_rank", int, "rank r of the Markov head (markov_w1 / markov_w2 [V, r]); both refuse 0"),
    ServingField("markov_head_type", str, "SGLang builds a vanilla, gated or rnn head from it (vLLM only vanilla)",
                 "vanilla", lambda v, c: v == "vanilla", read_by=(SGLANG,)),
    ServingField("confidence_head_with_markov", bool, "confidence head input: [h ; markov_w1[previous]] (true) or h",
                 ok=None),
    ServingField("enable_confidence_head", bool, "whether confidence_head.proj.* are in the file (SGLang warns when "
                 "absent; it and vLLM load the head only for adaptive verification)", ok=None, read_by=(SGLANG,)),
    ServingField("mask_token_id", int, "SGLang's DSpark parser reads it before dflash_config.mask_token_id, vLLM "
                 "after it", "dflash_config.mask_token_id", lambda v, c: v == c["dflash_config"]["mask_token_id"]),
    ServingField("target_layer_ids", list, "DeepSpec's key: vLLM's last fallback (+ 1) for the captured layers",
                 "dflash_config.target_layer_ids", lambda v, c: v == c["dflash_config"]["target_layer_ids"],
                 read_by=(VLLM,)),
    ServingField("num_anchors", int, "anchors per sequence the draft was trained with (draft.num_anchors): DeepSpec's "
                 "Qwen3DSparkModel asserts it (deepspec/modeling/dspark/qwen3/modeling.py @5905deb7); no engine reads "
                 "it", read_by=(DEEPSPEC,)),
)


def is_dspark_export(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a DSpark draft: DeepSpec's architecture, or its Markov head under another."""
    return ARCHITECTURE in (config.get("architectures") or []) or "markov_rank" in config


def dspark_built_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor -> (the shape both engines build it with from an export's config.json, from what): the Markov and
    confidence heads, which they load without checking that the file has them. KeyError / TypeError: a broken field."""
    h, v, r = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    built = {f"markov_head.markov_w{i}.weight": ((v, r), "vocab x markov_rank") for i in (1, 2)}
    if config["enable_confidence_head"]:
        width = h + (r if config["confidence_head_with_markov"] else 0)
        built["confidence_head.proj.weight"] = ((1, width), "1 x (hidden + markov_rank with markov)")
        built["confidence_head.proj.bias"] = ((1,), "one logit")
    return built


def dspark_serving_notes(config: dict[str, Any]) -> list[str]:
    """What `dflash export` adds under a DSpark export's commands: the counts, and what a draft without a confidence
    head must leave off."""
    notes = ["every slot proposes: vLLM drafts num_speculative_tokens = block_size tokens from the anchor and "
             "block_size - 1 masks, SGLang verifies block_size + 1 (the anchor and block_size drafts)"]
    if config.get("enable_confidence_head") is False:
        notes.append("no confidence head: keep SGLANG_RAGGED_VERIFY_MODE=static (the default) and vLLM's "
                     "adaptive_verification off, both of which need one")
    return notes


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

    @classmethod
    def proposals_per_block(cls, block_size: int) -> int:
        """Every slot proposes (slot k the token after slot k's), slot 0 included."""
        return block_size

    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor) -> torch.Tensor:
        """The Markov walk over every slot (`dspark_propose`; the confidence head never changes the drafts)."""
        return dspark_propose(self, hidden, first_token, head_weight)

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
