"""Greedy speculative decoding with a DFlash, Domino, DFlash 2 or DSpark draft (batch 1): generation, the lossless
check, and τ.

One decode step, with `start` the position of the last emitted token `t` (not yet seen by the target):

    draft   block = [t, mask x (bs-1)] at positions start..start+bs-1, attending to the draft's
            cached context K/V (target features of every position < start) and to its own block
            -> draft tokens d_1..d_{bs-1} = argmax(draft_hidden[slots 1..] @ lm_head^T)
            (the draft's own rule, `draft.propose`: Domino's correction head then runs causally over d_1..,
            DFlash 2's selector walks its top-K candidates; DSpark: every slot k proposes the token at start+k+1,
            d_1..d_bs by the Markov walk, `draft.proposals_per_block(bs)` = bs)
    target  one forward over [t, d_1..d_{v-1}] (v = min(bs, tokens still allowed)) with its KV cache
            -> greedy g_0..g_{v-1};  a = longest prefix with d_k == g_{k-1}
    emit    d_1..d_a and the bonus g_a (a + 1 tokens; cut after a stop token)
    keep    target KV cache cropped to positions < start + a + 1; the verification forward's
            features of those a + 1 positions are appended to the draft's context K/V
            (only the new positions are projected: a step costs O(new tokens) in the draft)

Target features are the *same* tensors the trainer uses (`FrozenTarget`): the output of decoder
layer i, captured by the same forward hooks (`dflash.target_model.frozen.capture_layer_outputs`), for i in
`target_layer_ids`. (HF's `hidden_states[L]` is after the final norm, so for the last layer it
differs from the hook; the hook keeps training and serving in agreement.)

Every emitted token is the target's own greedy choice given the emitted prefix, so the output equals
plain greedy decoding token for token (`evaluate_speculative` checks it). Up to numerics: the
verification runs several positions in one forward, which in bf16 can flip a near-tie argmax
relative to one-token decoding. `evaluate_speculative` therefore accepts a first difference only
where `near_tie` finds the two tokens' logits equal within bf16 rounding; it records the prompt and
position in `numerical_ties` and stops comparing that prompt there. Any other difference raises
`LosslessError`. In fp32 the check is exact in practice.

Definitions (all host-side, over the decode phase; the prefill's first token is not counted):
    acceptance length of a target forward = tokens it emitted = accepted drafts + 1, cut at a stop
        token or the `max_new_tokens` budget (the final block verifies only what the budget allows)
    τ = Σ acceptance lengths / number of target forwards = (new tokens - 1) / target forwards
    per-position acceptance rate k (k = 1..P, P = bs-1 proposals, DSpark's bs) = fraction of target forwards
        that verified proposal k in which it was accepted (the whole prefix 1..k matched): unconditional on k-1

Evaluation reads a token count to the host after every target forward and synchronizes around its
timers: it is a sync point by design, like the log flush and checkpoints, and never runs inside a
training step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.kinds.registry import kind_of
from dflash.modeling import DFlashDraftModel, cache_kwarg
from dflash.report.console import progress
from dflash.target_model.frozen import capture_layer_outputs, hf_model_of


class LosslessError(AssertionError):
    """Speculative output differs from the target's own greedy output."""

    def __init__(self, prompt_index: int, position: int, expected: list[int], got: list[int]) -> None:
        self.prompt_index, self.position = prompt_index, position
        exp = expected[position] if position < len(expected) else "<end>"
        act = got[position] if position < len(got) else "<end>"
        super().__init__(
            f"speculative decoding is not lossless on prompt {prompt_index}: first difference at new "
            f"token {position} (target greedy {exp}, speculative {act}; lengths {len(expected)} vs {len(got)})"
        )


@dataclass
class SpecResult:
    """One generation. `acceptance_lengths[i]` is what target forward i emitted (see module doc)."""

    output_ids: list[int]  # new tokens only; a stop token that ended generation is included
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_drafts: list[int] = field(default_factory=list)  # draft tokens accepted per forward
    verified_drafts: list[int] = field(default_factory=list)  # draft tokens verified per forward
    num_target_forwards: int = 0  # decode-phase target forwards (the prefill is not counted)
    wall_time_s: float = 0.0  # prefill + decode

    @property
    def tau(self) -> float:
        """Mean tokens per decode-phase target forward (nan when there was none)."""
        return sum(self.acceptance_lengths) / self.num_target_forwards if self.num_target_forwards else float("nan")


# ---- transformers compatibility ------------------------------------------------------------------


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of an HF KV cache (in place).

    transformers changed the meaning of `DynamicCache.crop`'s argument:
      older (4.x, early 5.x)  crop(max_length): absolute new length; a negative value removes
                              that many tokens; crop(0) empties the cache
      5.17                    crop(tokens_to_remove): a negative count removes tokens; a positive
                              value is still read as an absolute length, with a deprecation warning
      5.24                    crop(tokens_to_remove): negative count only; a positive value raises
    A negative count means "remove that many" in all three, so that is what we pass; and we never
    call crop(0) (a no-op now, "empty the cache" to the old API).
    """
    current = cache.get_seq_length()
    remove = current - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {current} positions to {length}")
    if remove == 0:
        return
    cache.crop(-remove)
    if cache.get_seq_length() != length:  # a cache class with yet other semantics: fail loudly
        raise RuntimeError(f"{type(cache).__name__}.crop(-{remove}) left {cache.get_seq_length()} "
                           f"positions, expected {length}")


def _target_forward(model: nn.Module, ids: torch.Tensor, cache: Any, *, last_only: bool = False):
    """Logits `[1, T, V]` (or `[1, 1, V]` with last_only) and the (in-place updated) KV cache."""
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, cache_kwarg(model.forward): cache}
    if last_only:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    new_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    return out.logits, new_cache


# ---- the draft side ------------------------------------------------------------------------------


class DraftContextCache:
    """The draft's per-layer context keys/values `[1, kv_heads, T, head_dim]`, grown in place.

    Buffers are allocated once for `capacity` positions; `append` projects only the new positions
    (`fc` -> `hidden_norm` -> k/v proj, k_norm, RoPE are all per-position, so appending equals
    recomputing everything).
    """

    def __init__(self, draft: DFlashDraftModel, capacity: int) -> None:
        self.draft, self.capacity, self.length = draft, capacity, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def append(self, features: torch.Tensor) -> None:
        """Add target features `[1, T, K*H]` at positions length..length+T-1."""
        t = features.shape[1]
        if self.length + t > self.capacity:
            raise ValueError(f"draft context overflow: {self.length} + {t} > capacity {self.capacity}")
        positions = torch.arange(self.length, self.length + t, device=features.device).unsqueeze(0)
        dtype = next(self.draft.parameters()).dtype
        new = self.draft.context_kv(features.to(dtype), positions)
        if not self.keys:
            for k, v in new:
                self.keys.append(k.new_empty(*k.shape[:2], self.capacity, k.shape[-1]))
                self.values.append(v.new_empty(*v.shape[:2], self.capacity, v.shape[-1]))
        for (k, v), kb, vb in zip(new, self.keys, self.values, strict=True):
            kb[:, :, self.length:self.length + t] = k
            vb[:, :, self.length:self.length + t] = v
        self.length += t

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.keys, self.values, strict=True)]


def propose_draft_tokens(draft: DFlashDraftModel, target_model: nn.Module, context: DraftContextCache,
                         first_token: torch.Tensor, start: int, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Greedy draft tokens `[1, draft.proposals_per_block(block_size)]` for the block starting at position `start`.

    `first_token` `[1, 1]` is slot 0 (the last emitted token); the other slots are the mask token.
    The draft sees every context position (all are < start) and its whole block, so no mask is needed.
    The tokens come from the draft's own rule (`DFlashDraftModel.propose`): DFlash's argmax of slots 1.., a Domino
    draft's causal correction head, a DFlash 2 draft's selector walk over the top-K candidates, a DSpark draft's
    Markov walk over every slot (its confidence head never changes them, and all of them are verified).
    """
    device = first_token.device
    ids = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)
    ids[:, :1] = first_token
    dtype = next(draft.parameters()).dtype
    embed = target_model.get_input_embeddings().weight
    embeds = F.embedding(ids, embed).to(dtype)
    positions = torch.arange(start, start + block_size, device=device).unsqueeze(0)
    hidden = draft(embeds, positions, None, ctx_kv=context.kv())  # [1, bs, H]
    head = target_model.get_output_embeddings().weight  # [V, H]
    return draft.propose(hidden, first_token, embed, head)


# ---- generation ----------------------------------------------------------------------------------


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _prompt_tensor(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"expected one non-empty prompt ([S] or [1, S]), got shape {tuple(ids.shape)}")
    return ids


def _cut_at_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[: i + 1]
    return tokens


# Decoding runs eagerly even when the trainer compiled the draft's layers in place (`compile: true`): the
# context grows by a few tokens every round, so a compiled layer would recompile at each new length until
# dynamo's limit (on an H200, 23 s of recompiles inside the timed decoding of a run's final evaluation,
# docs/benchmarks.md), and the speed-up would count them.
@torch.compiler.set_stance("force_eager")
def speculative_generate(
    target_model: nn.Module,
    draft: DFlashDraftModel,
    input_ids: Any,
    *,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
    mask_token_id: int | None = None,
    block_size: int | None = None,
) -> SpecResult:
    """Greedy speculative decoding of one prompt (`[S]` or `[1, S]`); see the module doc."""
    model = hf_model_of(target_model)
    cfg = draft.config
    bs = block_size or cfg.block_size
    if bs < 2:
        raise ValueError(f"block_size must be >= 2, got {bs}")
    if draft.fixed_block_size and bs != cfg.block_size:  # DFlash 2: its convs run over blocks of its own size
        raise ValueError(f"a {kind_of(cfg).title} draft decodes blocks of its block_size {cfg.block_size}, not {bs}")
    mask_id = cfg.mask_token_id if mask_token_id is None else mask_token_id
    width = draft.proposals_per_block(bs) + 1  # tokens one verification forward checks: the last emitted + proposals
    stops = set(stop_token_ids or ())
    device = model.get_input_embeddings().weight.device
    ids = _prompt_tensor(input_ids, device)
    prompt_len = ids.shape[1]
    result = SpecResult(output_ids=[])
    if max_new_tokens <= 0:
        return result
    was_training = draft.training
    draft.eval()
    try:
        with torch.inference_mode(), capture_layer_outputs(model, cfg.target_layer_ids) as captured:
            t0 = _now(device)
            logits, cache = _target_forward(model, ids, None, last_only=True)
            token = int(logits[0, -1].argmax())
            result.output_ids.append(token)
            context = DraftContextCache(draft, capacity=prompt_len + max_new_tokens + width)
            context.append(captured.features())  # prompt positions 0..P-1
            start = prompt_len  # position of `token`, slot 0 of the next block

            while len(result.output_ids) < max_new_tokens and token not in stops:
                verify = min(width, max_new_tokens - len(result.output_ids))  # slots the target checks
                token_t = torch.tensor([[token]], device=device)
                if verify > 1:
                    drafts = propose_draft_tokens(draft, model, context, token_t, start, bs, mask_id)[:, : verify - 1]
                    block = torch.cat([token_t, drafts.to(device)], dim=1)
                else:
                    block = token_t
                logits, cache = _target_forward(model, block, cache)
                greedy = logits[0].argmax(-1)  # [verify]: target's choice after each slot
                host = torch.cat([greedy, block[0, 1:]]).tolist()  # one device->host read per step
                g, d = host[:verify], host[verify:]
                accepted = next((k for k, (dk, gk) in enumerate(zip(d, g, strict=False)) if dk != gk), len(d))
                emitted = _cut_at_stop(d[:accepted] + [g[accepted]], stops)

                result.output_ids.extend(emitted)
                result.acceptance_lengths.append(len(emitted))
                result.accepted_drafts.append(accepted)
                result.verified_drafts.append(verify - 1)
                result.num_target_forwards += 1
                # Positions start..start+accepted (slot 0 and the accepted drafts) are now final:
                # keep them in the target's cache and add their features to the draft's context.
                crop_cache(cache, start + accepted + 1)
                context.append(captured.features()[:, : accepted + 1])
                start += accepted + 1
                token = emitted[-1]
            result.wall_time_s = _now(device) - t0
    finally:
        draft.train(was_training)
    return result


def target_generate(target_model: nn.Module, input_ids: Any, max_new_tokens: int,
                    stop_token_ids: Iterable[int] | None = None) -> SpecResult:
    """Plain greedy decoding with a KV cache: the speed baseline and the lossless reference."""
    model = hf_model_of(target_model)
    stops = set(stop_token_ids or ())
    device = model.get_input_embeddings().weight.device
    ids = _prompt_tensor(input_ids, device)
    result = SpecResult(output_ids=[])
    if max_new_tokens <= 0:
        return result
    with torch.inference_mode():
        t0 = _now(device)
        logits, cache = _target_forward(model, ids, None, last_only=True)
        token = int(logits[0, -1].argmax())
        result.output_ids.append(token)
        while len(result.output_ids) < max_new_tokens and token not in stops:
            logits, cache = _target_forward(model, torch.tensor([[token]], device=device), cache)
            token = int(logits[0, -1].argmax())
            result.output_ids.append(token)
            result.acceptance_lengths.append(1)
            result.accepted_drafts.append(0)
            result.verified_drafts.append(0)
            result.num_target_forwards += 1
        result.wall_time_s = _now(device) - t0
    return result


# ---- evaluation ----------------------------------------------------------------------------------


def check_lossless(prompt_index: int, expected: list[int], got: list[int],
                   near_tie: Callable[[int], bool] | None = None) -> int | None:
    """None when the two token lists are equal. At the first difference: its position when
    `near_tie(position)` says both tokens are the target's greedy choice up to rounding, otherwise
    raise `LosslessError`."""
    if expected == got:
        return None
    position = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                    min(len(expected), len(got)))
    if near_tie is not None and position < min(len(expected), len(got)) and near_tie(position):
        return position
    raise LosslessError(prompt_index, position, expected, got)


@torch.inference_mode()
def near_tie(target_model: nn.Module, prompt: Sequence[int], expected: list[int], got: list[int], position: int,
             ulps: float = 4.0) -> bool:
    """Whether `expected[position]` and `got[position]` are tied in the target's logits after the
    common prefix, within `ulps` units of the model dtype's rounding at the logits' scale. A bf16
    verification forward over a block and one-token decoding round differently and can pick either
    of two (near-)equal logits; that is not a draft error. One full forward without a cache."""
    param = next(target_model.parameters())
    ids = torch.tensor([list(prompt) + list(expected[:position])], device=param.device)
    logits = target_model(input_ids=ids).logits[0, -1].float()
    gap = (logits[expected[position]] - logits[got[position]]).abs()
    return bool(gap <= ulps * torch.finfo(param.dtype).eps * logits.abs().max().clamp(min=1.0))


def acceptance_stats(results: Sequence[SpecResult], block_size: int) -> dict[str, Any]:
    """τ, the acceptance-length histogram and per-position acceptance rates over many generations; `block_size`:
    the verification width (the proposals per block + 1: a DSpark block of bs verifies bs + 1 tokens)."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    forwards = sum(r.num_target_forwards for r in results)
    histogram = [0] * (block_size + 1)  # histogram[n] = forwards that emitted n tokens (n = 1..width)
    for n in lengths:
        histogram[n] += 1
    pairs = [(a, v) for r in results for a, v in zip(r.accepted_drafts, r.verified_drafts, strict=True)]
    per_position = []
    for k in range(1, block_size):
        verified = sum(1 for _, v in pairs if v >= k)
        hits = sum(1 for a, v in pairs if v >= k and a >= k)
        per_position.append(hits / verified if verified else float("nan"))
    return {
        "tau": sum(lengths) / forwards if forwards else float("nan"),
        "acceptance_histogram": histogram[1:],  # index i -> acceptance length i + 1
        "per_position_acceptance": per_position,  # index i -> draft slot i + 1
        "target_forwards": forwards,
        # Per generation, in prompt order: a subset's τ is Σ tau_i * forwards_i / Σ forwards_i, so runs that
        # decode different prompt counts still compare on their common prompts.
        "per_prompt_tau": [r.tau for r in results],
        "per_prompt_target_forwards": [r.num_target_forwards for r in results],
    }


def evaluate_speculative(
    target_model: nn.Module,
    draft: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    stop_token_ids: Iterable[int] | None = None,
    block_size: int | None = None,
    warmup: bool = True,
    return_texts: bool = False,
) -> dict[str, Any]:
    """Speculative vs plain greedy decoding on every prompt; raises `LosslessError` on any difference.

    Returns τ, `acceptance_histogram`, `per_position_acceptance` (module doc), new tokens, target
    forwards, tokens/s of both (new tokens / wall time including prefill) and `speedup`. A sync
    point by design (host reads every step, synchronized timers). `warmup` first runs both briefly
    on the first prompt so one-time costs (kernel selection, allocator) are not timed. With
    `return_texts`, `texts` holds each prompt with its speculative output, `(prompt ids, output ids)`.
    """
    stops = list(stop_token_ids or ())
    bs = block_size or draft.config.block_size
    if warmup and prompts:
        target_generate(target_model, prompts[0], min(max_new_tokens, 2 * bs), stops)
        speculative_generate(target_model, draft, prompts[0], max_new_tokens=min(max_new_tokens, 2 * bs),
                             stop_token_ids=stops, block_size=bs)
    spec_results, base_results, ties = [], [], []
    for i, prompt in enumerate(progress(prompts, desc="speculative eval", unit="prompt")):
        base = target_generate(target_model, prompt, max_new_tokens, stops)
        spec = speculative_generate(target_model, draft, prompt, max_new_tokens=max_new_tokens,
                                    stop_token_ids=stops, block_size=bs)
        tie = check_lossless(i, base.output_ids, spec.output_ids,
                             functools.partial(near_tie, target_model, prompt, base.output_ids, spec.output_ids))
        if tie is not None:
            ties.append({"prompt": i, "position": tie})
        base_results.append(base)
        spec_results.append(spec)
    new_tokens = sum(len(r.output_ids) for r in spec_results)
    spec_time = sum(r.wall_time_s for r in spec_results)
    base_time = sum(r.wall_time_s for r in base_results)
    spec_tps = new_tokens / spec_time if spec_time > 0 else float("nan")
    base_tps = new_tokens / base_time if base_time > 0 else float("nan")
    report = {
        **acceptance_stats(spec_results, draft.proposals_per_block(bs) + 1),
        "block_size": bs,
        "num_prompts": len(prompts),
        "new_tokens": new_tokens,
        "speculative_tokens_per_s": spec_tps,
        "target_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps if base_tps > 0 else float("nan"),
        "numerical_ties": ties,  # prompts whose outputs parted at a rounding tie (see `near_tie`)
    }
    if return_texts:
        report["texts"] = [(list(p), list(r.output_ids)) for p, r in zip(prompts, spec_results, strict=True)]
    return report
