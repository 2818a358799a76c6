"""What several test files build: tiny targets and configs from code (no hub), random batches, the tiny chat target
folder and conversations file, and `check_speculative_report` (the identities of a speculative-decoding report).
A module of its own, imported by name (`from helpers import ...`); `conftest.py` keeps the environment and the
fixtures built on these."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 128
TINY_MASK_ID = TINY_VOCAB - 1
DOMINO_HEAD = {"draft__kind": "domino", "domino__gru_hidden_dim": 32, "domino__emb_dim": 16}  # a small Domino head
# A small DFlash 2 head: 48 of 128 candidates, so a random draft has gold tokens both inside and outside the top-K
DFLASH2_HEAD = {"draft__kind": "dflash2", "dflash2__selector_rank": 8, "dflash2__selector_top_k": 48}
# tiny_config's keys of a small draft of each kind (`draft.kind`), in the registry's order
KIND_HEADS = {"dflash": {}, "domino": DOMINO_HEAD, "dflash2": DFLASH2_HEAD,
              "dspark": {"draft__kind": "dspark", "dspark__markov_rank": 8}}


def make_tiny_target(num_layers: int = 4, hidden: int = 64, vocab: int = TINY_VOCAB, seed: int = 0,
                     head_std: float = 1.0):
    """A 4-layer Llama of hidden 64. The LM head gets std `head_std` so that logits can be peaked
    (a freshly initialised head with std 0.02 caps how low any draft's CE can go)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, head_std)
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return model.eval()


def tiny_config(**overrides):
    from dflash.config import TrainConfig

    cfg = TrainConfig(max_steps=100, batch_size=4, device="cpu", dtype="float32", ce_chunk_size=64)
    cfg.draft.num_layers = 2
    cfg.draft.block_size = 4
    cfg.draft.num_anchors = 8
    cfg.draft.mask_token_id = TINY_MASK_ID
    cfg.optim.lr = 3e-3
    for key, value in overrides.items():
        cfg.set(key.replace("__", "."), value)
    return cfg


def random_batch(batch: int = 4, seq: int = 32, prompt: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_VOCAB - 1, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq, dtype=torch.bool)
    loss_mask[:, :prompt] = False
    return {"input_ids": ids, "loss_mask": loss_mask}


def make_chat_target(tokenizer, num_layers: int = 2, hidden: int = 64, seed: int = 0):
    """A random Llama over `tokenizer`'s vocabulary (SmolLM2's: its bos / eos / pad ids), for the code
    paths that chat-render, regenerate and stop at <|im_end|>."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = hidden // 16
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, intermediate_size=2 * hidden, vocab_size=len(tokenizer),
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(cfg).eval()


def continuation_batch(target, num_prompts: int = 8, prompt_len: int = 6, new_tokens: int = 26):
    """Rows of random prompts followed by the target's own greedy continuations (a draft can learn
    their cycles quickly); loss_mask covers the continuations."""
    from dflash.evaluation.speculative import target_generate

    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(0, 100, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    ids = torch.tensor([p + target_generate(target, p, new_tokens).output_ids for p in prompts])
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :prompt_len] = False
    return ids, loss_mask


def train_on_continuations(target, steps: int = 20, **overrides):
    """A trainer whose draft was trained briefly on the target's own greedy continuations (it learns
    their cycles, so real speculative decoding accepts tokens). `overrides`: tiny_config's (a Domino head)."""
    from dflash.trainer import DFlashTrainer

    ids, loss_mask = continuation_batch(target)
    trainer = DFlashTrainer(tiny_config(**{"max_steps": steps, "optim__lr": 1e-2, **overrides}), target=target)
    for step in range(steps):
        rows = torch.arange(4) + (4 * step) % 8
        trainer.train_step({"input_ids": ids[rows], "loss_mask": loss_mask[rows]})
    return trainer


def check_speculative_report(report: dict) -> None:
    """The identities of an `evaluate_speculative` report (`dflash.evaluation.speculative`'s module doc): τ is
    the decode-phase tokens per target forward, read from the acceptance histogram, from the new-token count
    (the prefill makes each prompt's first token), and from the per-prompt τ; per-position acceptance bounds
    it (mean accepted drafts per forward <= the sum of the per-slot rates). A τ computed off any of these
    fails here; `1 <= τ <= block_size` alone would not catch a τ off by a fraction."""
    bs, forwards, prompts = report["block_size"], report["target_forwards"], report["num_prompts"]
    hist = report["acceptance_histogram"]
    assert len(hist) == bs and sum(hist) == forwards > 0, report
    emitted = sum((i + 1) * n for i, n in enumerate(hist))
    assert emitted == report["new_tokens"] - prompts, report
    assert report["tau"] == pytest.approx(emitted / forwards, rel=1e-12), report
    assert 1.0 <= report["tau"] <= bs, report
    rates = report["per_position_acceptance"]
    assert len(rates) == bs - 1 and all(0.0 <= r <= 1.0 for r in rates if r == r), rates  # nan: slot never verified
    assert report["tau"] <= 1.0 + sum(r for r in rates if r == r) + 1e-9, report
    taus, per_prompt = report["per_prompt_tau"], report["per_prompt_target_forwards"]
    assert len(taus) == len(per_prompt) == prompts and sum(per_prompt) == forwards, report
    weighted = sum(t * f for t, f in zip(taus, per_prompt, strict=True) if f)  # a prompt stopped by its prefill: nan
    assert weighted / forwards == pytest.approx(report["tau"], rel=1e-9), report


def save_tiny_target(path) -> None:
    """A 4-layer Llama with the SmolLM2 tokenizer (and chat template), saved like any HF model folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflash.embedded import embedded_target_dir

    tok = AutoTokenizer.from_pretrained(embedded_target_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=len(tok), max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def chat_file(path: Path) -> Path:
    """40 short two-turn conversations as a JSONL file (replies of one to three sentences)."""
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 3)},
            ]}) + "\n")
    return path
