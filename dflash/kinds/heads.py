"""What every kind's head config shares: its published keys are the fields of a frozen dataclass, read by
name from the kind's config section (`domino.*`, `dflash2.*`, `dspark.*`) and written into a draft config's
`extra`, where the export and `load_exported` find them."""

from __future__ import annotations

import dataclasses
from typing import Any, Self


class HeadKeys:
    """Mixed into a kind's frozen dataclass of head keys (the settings section holds the same names)."""

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        """The head keys of the kind's config section (its loss settings stay with the objective)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})

    def to_extra(self) -> dict[str, Any]:
        """The keys as a draft config's `extra` entries."""
        return dataclasses.asdict(self)
