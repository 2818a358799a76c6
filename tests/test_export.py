"""The published checkpoint format (DESIGN §5): config fields, exact tensor names, bf16, round trip."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import DOMINO_HEAD, TINY_MASK_ID, make_chat_target, make_tiny_target, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.embedded import EMBEDDED_MASK_TOKEN, EMBEDDED_MASK_TOKEN_TEXT
from dflash.evaluation.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_compatible,
    draft_config_from_json,
    expected_weight_names,
    export_checkpoint,
    export_draft,
    load_exported,
    trained_target,
)
from dflash.factory import build_draft
from dflash.kinds.domino import DominoDraftModel, DominoHeadConfig
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.run.checkpoint import save_checkpoint

LAYERS = 2


def _draft(target, **overrides) -> DFlashDraftModel:
    torch.manual_seed(0)
    cfg = DFlashDraftConfig.for_target(target.config, mask_token_id=TINY_MASK_ID, num_hidden_layers=LAYERS,
                                       block_size=4, **overrides)
    draft = DFlashDraftModel(cfg)
    with torch.no_grad():  # non-trivial norms, so a swapped or missing norm weight would show
        for p in draft.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return draft.eval()


def _inputs(cfg: DFlashDraftConfig):
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 10, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    noise = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
    pos = torch.arange(10, 10 + cfg.block_size).unsqueeze(0)
    return noise, pos, feats


# ---- the files -------------------------------------------------------------------------------------


def test_config_json_has_every_published_field(target, tmp_path):
    draft = _draft(target)
    export_draft(draft, tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    c = draft.config
    expected = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,  # the target's
        "num_hidden_layers": LAYERS,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": 128,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * LAYERS,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "block_size": 4,
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": TINY_MASK_ID, "target_layer_ids": c.target_layer_ids},
    }
    for key, value in expected.items():
        assert cfg[key] == value, key
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


def test_config_json_names_the_target_and_the_layers_in_vllms_convention(target, tmp_path):
    """`eagle_aux_hidden_state_layer_ids` is what vLLM's runner reads first: aux id j is the hidden state
    entering layer j, i.e. the output of layer j - 1, so our output-of-layer ids shift by one (an older vLLM
    that takes `target_layer_ids` as aux ids reads each layer one too early). The target is recorded for
    `dflash eval`, and an export read back and written again keeps it (same bytes)."""
    draft = _draft(target, target_layer_ids=[0, 2])
    export_draft(draft, tmp_path / "a", target="org/tiny-target")
    cfg = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3] and cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["dflash_config"]["target"] == trained_target(tmp_path / "a") == "org/tiny-target"
    export_draft(load_exported(tmp_path / "a"), tmp_path / "b")  # bf16 weights round-trip exactly
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    export_draft(draft, tmp_path / "c")
    assert trained_target(tmp_path / "c") is None  # not recorded: `dflash eval` then takes its default


def test_safetensors_names_are_exactly_the_published_ones_in_bf16(target, tmp_path):
    draft = _draft(target)
    export_draft(draft, tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        names = set(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
        assert f.metadata() == {"format": "pt"}  # what HF from_pretrained expects
    per_layer = {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight",
    }
    spelled_out = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(LAYERS) for n in per_layer}
    assert names == spelled_out == expected_weight_names(LAYERS)  # no extra, none missing
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    k = len(draft.config.target_layer_ids)
    assert tensors["fc.weight"].shape == (64, k * 64)
    for name, p in draft.state_dict().items():
        assert torch.equal(tensors[name], p.to(torch.bfloat16)), name


def test_round_trip_gives_identical_outputs(target, tmp_path):
    draft = _draft(target, target_layer_ids=[1, 2])
    draft.config.extra = {"projector_type": "dflash", "custom_key": 3}
    export_draft(draft, tmp_path)
    loaded = load_exported(tmp_path, target_model=target)
    assert loaded.config == draft.config  # extra keys survive under dflash_config
    assert next(loaded.parameters()).dtype == torch.float32 and not loaded.training
    reference = DFlashDraftModel(draft.config)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in draft.state_dict().items()})
    noise, pos, feats = _inputs(draft.config)
    with torch.no_grad():
        out = loaded(noise, pos, None, target_hidden=feats)
        torch.testing.assert_close(out, reference(noise, pos, None, target_hidden=feats), rtol=0, atol=0)
        # and close to the fp32 original (bf16 rounding of the weights only)
        torch.testing.assert_close(out, draft(noise, pos, None, target_hidden=feats), rtol=0.05, atol=0.05)
    bf16 = load_exported(tmp_path, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_key_set_mismatch_is_named(target, tmp_path):
    export_draft(_draft(target), tmp_path)
    state = load_file(str(tmp_path / WEIGHTS_NAME))
    state.pop("layers.1.mlp.up_proj.weight")
    state["model.embed_tokens.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / WEIGHTS_NAME), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected \['model.embed_tokens.weight'\]"):
        load_exported(tmp_path)


def test_shape_mismatch_and_unsupported_config_are_refused(target, tmp_path):
    export_draft(_draft(target), tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    cfg["intermediate_size"] += 2
    (tmp_path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        load_exported(tmp_path)
    with pytest.raises(ValueError, match="sliding_attention"):
        draft_config_from_json({**cfg, "layer_types": ["sliding_attention"] * LAYERS})
    with pytest.raises(ValueError, match="missing"):
        draft_config_from_json({"model_type": "qwen3", "hidden_size": 64})
    with pytest.raises(FileNotFoundError):
        load_exported(tmp_path / "nowhere")


# ---- compatibility with a target -------------------------------------------------------------------


def test_mismatched_target_gives_a_clear_error(target, tmp_path):
    draft = _draft(target)
    check_compatible(draft.config, target)  # fine
    with pytest.raises(ValueError, match="hidden size: draft 64, target 32"):
        check_compatible(draft.config, make_tiny_target(hidden=32))
    with pytest.raises(ValueError, match="number of layers: .*num_target_layers=4, this target has 6"):
        check_compatible(draft.config, make_tiny_target(num_layers=6))
    with pytest.raises(ValueError, match="out of range for 2 layers"):
        check_compatible(draft.config, make_tiny_target(num_layers=2))
    with pytest.raises(ValueError, match="embedding has 96 rows"):
        check_compatible(draft.config, make_tiny_target(vocab=96))
    export_draft(draft, tmp_path)
    with pytest.raises(ValueError, match="hidden size"):
        load_exported(tmp_path, target_model=make_tiny_target(hidden=32))


# ---- what other readers see ------------------------------------------------------------------------


def test_qwen3_config_parses_the_export(target, tmp_path):
    from transformers import AutoConfig, Qwen3Config

    # a Domino draft: its variant keys go into dflash_config (a plain DFlash draft with them is refused: its weights
    # lack the head the keys name)
    cfg = _draft(target).config
    cfg.extra = DominoHeadConfig(emb_dim=32, gru_hidden_dim=8, pure_draft_prefix_len=1, shift_label=False).to_extra()
    draft = DominoDraftModel(cfg)
    export_draft(draft, tmp_path)
    for cfg in (Qwen3Config.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert isinstance(cfg, Qwen3Config)
        assert cfg.architectures == ["DFlashDraftModel"]
        assert cfg.dflash_config == {"mask_token_id": TINY_MASK_ID, "target_layer_ids": draft.config.target_layer_ids,
                                     "projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 8,
                                     "pure_draft_prefix_len": 1, "shift_label": False}
        assert cfg.block_size == 4 and cfg.num_target_layers == 4
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size) == (64, LAYERS, 16, 128)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
        assert cfg.intermediate_size == draft.config.intermediate_size
        assert cfg.layer_types == ["full_attention"] * LAYERS
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        assert theta == draft.config.rope_theta
        assert cfg.tie_word_embeddings is False


class _Qwen3StyleDFlash(nn.Module):
    """What a reader built only from the parsed Qwen3Config expects: transformers' own Qwen3 decoder
    layers under `layers.N`, plus `fc`, `hidden_norm`, `norm` (the reference DFlash module's layout)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        k = len(cfg.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


def test_a_qwen3_style_dflash_module_loads_the_weights_strictly(target, tmp_path):
    from transformers import Qwen3Config

    draft = _draft(target)
    export_draft(draft, tmp_path)
    reader = _Qwen3StyleDFlash(Qwen3Config.from_pretrained(tmp_path))
    state = load_file(str(tmp_path / WEIGHTS_NAME))
    want = {n: tuple(t.shape) for n, t in reader.state_dict().items()}
    assert want == {n: tuple(t.shape) for n, t in state.items()}
    reader.load_state_dict(state, strict=True)
    # the same tensors reach the same modules
    torch.testing.assert_close(reader.layers[1].self_attn.k_norm.weight,
                               draft.layers[1].self_attn.k_norm.weight.to(torch.bfloat16).float())


# ---- what the engines' and peers' loaders need beyond the draft's shape ------------------------------------------


@pytest.mark.parametrize("kind", ["dflash", "domino", "dspark"])
def test_the_mask_token_text_of_the_trained_id_is_written(tokenizer, tmp_path, kind):
    """SGLang's DFlash worker resolves the mask by `dflash_config.mask_token` (default <|MASK|>; an older one by that
    text alone), so the export writes the target tokenizer's text of the trained id: the embedded target's
    <empty_output> (id 16), which SGLang's lookup (the tokenizer's vocabulary) maps back to the trained row."""
    heads = {"dflash": {}, "domino": DOMINO_HEAD, "dspark": {"draft__kind": "dspark", "dspark__markov_rank": 4}}[kind]
    config = tiny_config(**heads, draft__mask_token_id=EMBEDDED_MASK_TOKEN_TEXT)  # set by its text, as a user may
    export_draft(build_draft(config, make_chat_target(tokenizer), tokenizer), tmp_path / "a")
    written = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())["dflash_config"]
    assert (written["mask_token"], written["mask_token_id"]) == (EMBEDDED_MASK_TOKEN_TEXT, EMBEDDED_MASK_TOKEN) == (
        "<empty_output>", 16)
    assert tokenizer.get_vocab()[written["mask_token"]] == written["mask_token_id"]
    export_draft(load_exported(tmp_path / "a"), tmp_path / "b")  # read back and written again: kept
    assert (tmp_path / "a" / CONFIG_NAME).read_bytes() == (tmp_path / "b" / CONFIG_NAME).read_bytes()


def test_exports_without_the_mask_token_text_still_load(tokenizer, tmp_path):
    """Exports written before `dflash_config.mask_token` (or of a draft built without a tokenizer) load and export
    again without it; a mask row past the tokenizer's vocabulary (Qwen3 pads its embedding table) has no text."""
    target = make_chat_target(tokenizer)
    export_draft(build_draft(tiny_config(draft__mask_token_id=EMBEDDED_MASK_TOKEN), target, tokenizer), tmp_path / "a")
    config = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    del config["dflash_config"]["mask_token"]
    (tmp_path / "a" / CONFIG_NAME).write_text(json.dumps(config))  # as an earlier version wrote it
    export_draft(load_exported(tmp_path / "a"), tmp_path / "b")
    assert "mask_token" not in json.loads((tmp_path / "b" / CONFIG_NAME).read_text())["dflash_config"]
    target.resize_token_embeddings(len(tokenizer) + 8)
    draft = build_draft(tiny_config(draft__mask_token_id=len(tokenizer) + 3), target, tokenizer)
    export_draft(draft, tmp_path / "c")
    written = json.loads((tmp_path / "c" / CONFIG_NAME).read_text())["dflash_config"]
    assert written["mask_token_id"] == len(tokenizer) + 3 and "mask_token" not in written


def test_a_dspark_export_carries_deepspecs_num_anchors(target, tmp_path):
    """DeepSpec's Qwen3DSparkModel asserts a top-level `num_anchors` (the anchors per sequence it was trained with):
    the export writes `draft.num_anchors`, reads it back, and `dflash export` of a DSpark checkpoint saved before the
    draft config recorded it takes it from the run's config.yaml."""
    config = tiny_config(draft__kind="dspark", dspark__markov_rank=4, draft__num_anchors=24)
    draft = build_draft(config, target, None)
    export_draft(draft, tmp_path / "a")
    written = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert written["num_anchors"] == 24 and "num_anchors" not in written["dflash_config"]  # DeepSpec's place only
    assert load_exported(tmp_path / "a").config == draft.config
    old = draft.config.to_dict()
    del old["extra"]["num_anchors"]  # a checkpoint written before the factory put it into the draft config
    run = tmp_path / "run"
    save_checkpoint(run, 4, draft.state_dict(), old, {"step": 4})
    (run / "config.yaml").write_text(yaml.safe_dump({"target": "org/t", "draft": {"num_anchors": 24}, "data": {}}))
    _, out = export_checkpoint(run, tmp_path / "from-checkpoint")
    assert json.loads((out / CONFIG_NAME).read_text())["num_anchors"] == 24
    plain = build_draft(tiny_config(), target, None)  # other kinds train anchors too, but no reader asks for them
    export_draft(plain, tmp_path / "dflash")
    assert "num_anchors" not in json.loads((tmp_path / "dflash" / CONFIG_NAME).read_text())
