"""A bad row, and pre-tokenized rows: what agent frameworks log, trained exactly as given.

A *token row* carries ``input_ids`` (list of ints) and ``loss_mask`` (list of 0/1 or bools, as long), with or
without the conversation it was rendered from; normalized it is ``{"id": str, "input_ids": list[int], "loss_mask": list[int]}``.
It is never re-templated nor regenerated. Its checks here need no tokenizer; the vocabulary bound
(``len(tokenizer)``) is checked where the tokenizer is known (`dflash.data.tokenization`). Every failed
check is a :class:`BadRow` whose ``reason`` `dflash.data.sources` counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dflash.anchors import has_valid_anchor

# Fields of a conversation row (`sources.normalize_row`'s shapes): with one, a row is a token row only with both
# token fields.
CONVERSATION_FIELDS = ("messages", "conversations", "prompt", "instruction")
TOKEN_FIELDS = ("input_ids", "loss_mask")
TOO_SHORT = "no two consecutive supervised tokens"  # the one anchor rule (`anchors.has_valid_anchor`), for both shapes
NOT_TOKEN_LISTS = "token row without input_ids and loss_mask lists of ints"
LENGTHS_DIFFER = "token row lengths differ"
EMPTY_TOKENS = "empty token row"
MASK_NOT_BINARY = "loss_mask values outside 0/1"
NEGATIVE_IDS = "negative token ids"
OUTSIDE_VOCABULARY = "token ids outside the vocabulary"


class BadRow(ValueError):
    """A row that cannot become a conversation or a token row; ``reason`` is the category it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def is_token_row(row: Any) -> bool:
    """Whether ``row`` (raw or normalized) is a token row: it sets both ``input_ids`` and ``loss_mask`` (the ids a
    framework logged are what its model saw: they win over ``messages`` logged beside them), or one of them and no
    conversation field (then a token row that fails :func:`token_row`, named as such)."""
    if not isinstance(row, Mapping):
        return False
    given = [row.get(k) is not None for k in TOKEN_FIELDS]
    return all(given) or (any(given) and all(row.get(k) is None for k in CONVERSATION_FIELDS))


def mixed_shape(first: str, where: str) -> BadRow:
    """The bad row of a source's other shape: `first` ("token rows" or "conversations") is the shape of its first
    usable row, at `where`. A source is trained one way: as given, or through the chat template."""
    other = "conversation" if first == "token rows" else "token row"
    return BadRow(f"{other} in a source of {first} (mixed shapes)",
                  f"the first usable row ({where}) made it a source of {first}; give each shape its own source")


def _ints(value: Any, *, bools: bool) -> list[int] | None:
    """`value` as a list of ints (bools too when `bools`), else None."""
    if not isinstance(value, (list, tuple)):
        return None
    if not all(isinstance(v, int) and (bools or not isinstance(v, bool)) for v in value):
        return None
    return [int(v) for v in value]


def token_row(row: Mapping[str, Any]) -> dict[str, list[int]]:
    """``{"input_ids", "loss_mask"}`` of a raw token row, both ``list[int]`` of one length, checked; raises
    :class:`BadRow`: not both lists of ints, lengths differ, empty, mask values outside {0, 1}, negative ids,
    no two consecutive supervised tokens (such a row never trains a block)."""
    ids, mask = _ints(row.get("input_ids"), bools=False), _ints(row.get("loss_mask"), bools=True)
    if ids is None or mask is None:
        kinds = ", ".join(f"{k}: {type(row.get(k)).__name__}" for k in TOKEN_FIELDS)
        raise BadRow(NOT_TOKEN_LISTS, kinds)
    if len(ids) != len(mask):
        raise BadRow(LENGTHS_DIFFER, f"input_ids {len(ids)}, loss_mask {len(mask)}")
    if not ids:
        raise BadRow(EMPTY_TOKENS)
    if (bad := next((v for v in mask if v not in (0, 1)), None)) is not None:
        raise BadRow(MASK_NOT_BINARY, str(bad))
    if min(ids) < 0:
        raise BadRow(NEGATIVE_IDS, str(min(ids)))
    if not has_valid_anchor(mask):
        raise BadRow(TOO_SHORT)
    return {"input_ids": ids, "loss_mask": mask}


def token_prompt_id(ids: Sequence[int]) -> str:
    """Stable id of a token prompt: 16 hex digits of the SHA-256 of its ids (the token rows' `prompt_id`)."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def first_prompt(row: Mapping[str, Any]) -> list[int]:
    """The ids of a token row before its first supervised token: what the row opens with, as a conversation
    opens with its first user turn."""
    mask = row["loss_mask"]
    return list(row["input_ids"][: mask.index(1) if 1 in mask else len(mask)])


def last_turn_prompt(row: Mapping[str, Any]) -> list[int]:
    """The ids of a token row before the start of its last run of supervised tokens: for a multi-turn row, the
    whole history before the last assistant turn, the prompt the target answered last."""
    mask = row["loss_mask"]
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    while end and mask[end - 1]:
        end -= 1
    return list(row["input_ids"][:end])
