"""Shared fixtures: tiny targets built from config (no hub), offline environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# One thread per process (the test's and every process it starts) unless a test says otherwise: the steps
# here are tiny, and on shared CI cores torch's default thread count stalls in OpenMP (one test 54 s -> 2.8 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # also where the environment already set OMP_NUM_THREADS to more

TINY_VOCAB = 128
TINY_MASK_ID = TINY_VOCAB - 1


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


@pytest.fixture
def tiny_target():
    return make_tiny_target()


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


def train_on_continuations(target, steps: int = 20):
    """A trainer whose draft was trained briefly on the target's own greedy continuations (it learns
    their cycles, so real speculative decoding accepts tokens)."""
    from dflash.trainer import DFlashTrainer

    ids, loss_mask = continuation_batch(target)
    trainer = DFlashTrainer(tiny_config(max_steps=steps, optim__lr=1e-2), target=target)
    for step in range(steps):
        rows = torch.arange(4) + (4 * step) % 8
        trainer.train_step({"input_ids": ids[rows], "loss_mask": loss_mask[rows]})
    return trainer


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


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-target")
    save_tiny_target(out)
    return out


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    return chat_file(tmp_path_factory.mktemp("data") / "chats.jsonl")
