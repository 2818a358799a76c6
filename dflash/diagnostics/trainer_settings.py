"""Which `transformers.TrainingArguments` settings add a host-device sync to every training step.

`dflash.hf.trainer.DFlashCallback` warns once per setting found here (category `DFlashSyncWarning`);
`SyncProbe` (`dflash.diagnostics.probe`) shows the syncs they make on a real run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DFlashSyncWarning", "per_step_sync_settings"]


class DFlashSyncWarning(UserWarning):
    """A Trainer setting adds a host-device sync to every training step."""


def per_step_sync_settings(args: Any, device_type: str | None = None) -> list[str]:
    """Messages, one per `TrainingArguments` setting that makes every step wait for the device.

    `device_type` defaults to `args.device.type`; the pinned / non_blocking checks apply to CUDA
    only (on the CPU there is no copy). The CPU-visible settings are the ones `SyncProbe` finds
    (tests/test_hf.py); the CUDA-only ones follow from the transformers / accelerate source.
    docs/trainer_integration.md has the table.
    """
    device_type = device_type or args.device.type
    found = []
    if args.logging_nan_inf_filter:
        found.append("logging_nan_inf_filter=True: the Trainer tests every micro-batch loss with "
                     "`torch.isnan(loss) or torch.isinf(loss)` on the host (a device read per micro-batch); "
                     "set logging_nan_inf_filter=False")
    if args.include_num_input_tokens_seen not in ("no", False, None):
        found.append(f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: the Trainer "
                     "adds the token count to state with `.item()` every micro-batch; set it to 'no' "
                     "(DFlashCallback logs supervised tokens at logging steps)")
    if args.torch_empty_cache_steps:
        found.append(f"torch_empty_cache_steps={args.torch_empty_cache_steps}: emptying the CUDA cache "
                     "frees memory with cudaFree, which waits for the device; leave it None")
    if args.fp16 and "fused" not in str(args.optim):
        found.append("fp16=True with a non-fused optimizer: torch's GradScaler reads found_inf with `.item()` "
                     "before every optimizer step; use bf16=True (no scaler) or a fused optimizer")
    if device_type == "cuda":
        non_blocking = bool(getattr(args.accelerator_config, "non_blocking", False))
        if not non_blocking:
            found.append("accelerator_config.non_blocking=False: accelerate copies each batch to the GPU "
                         "with a blocking copy, which waits for the queued work; pass "
                         "accelerator_config={'non_blocking': True} (with dataloader_pin_memory=True)")
        elif not args.dataloader_pin_memory:
            found.append("dataloader_pin_memory=False: a non_blocking copy from pageable memory still "
                         "blocks the host; set dataloader_pin_memory=True")
    return found
