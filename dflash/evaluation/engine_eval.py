"""`dflash eval --engine vllm`: the export served by vLLM as the speculative draft of its target, measured by vLLM's
own counters, checked lossless against vLLM's plain greedy output, and reported beside dflash's own τ on the same
prompts and token budget.

Three decodings of the same prompts (`prompt_ids` of `eval_conversations`, greedy, the same stop tokens and budget),
one after the other so that only one model is in memory at a time:
    dflash   `run_eval`: dflash's own decoder, batch 1; τ and its per-position acceptance (`speculative.py`)
    greedy   vLLM without a draft: the reference outputs and the baseline tokens/s
    vLLM     vLLM with `speculative_config` = the export: outputs, tokens/s and the speculative counters
             (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
             `..._num_accepted_tokens_per_pos`, read from `LLM.get_metrics` before and after `generate`)

The figures, named as the report names them:
    vllm.mean_acceptance_length   vLLM's own: 1 + accepted / drafts (a draft = one verification step of one request).
                                  vLLM counts the accepted drafts of a request's last step before cutting at the
                                  budget or a stop token, so it reads a little above dflash's τ on the same tokens.
    vllm.emitted_per_step         (new tokens - prompts) / drafts: the decode-phase tokens per verification step,
                                  cut at the budget and stops as dflash's τ is (the prefill's first token excluded)
    vllm.per_position_acceptance  accepted at draft position k / drafts (vLLM's; dflash's rate divides by the steps
                                  that verified position k, which differ only at a request's last step)
    dflash.tau                    dflash's own τ (`acceptance_stats`)
vLLM decodes the prompts as one batch (continuous batching), dflash one at a time: tokens/s are each engine's own.

Refused before any model loads, with one line saying why (`vllm_refusal`, from the kind's record): Domino (vLLM has
no Domino head, `Serving.vllm_unservable`), and DFlash 2 / DSpark on a CPU (`Serving.vllm_cpu_refusal`: vLLM 0.32's
V1 model runner, the CPU one, refuses "dspark speculative decoding" and "DFlash candidate-head drafts"; its V2 runner,
which serves them, needs Triton on a GPU).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash.data.regenerate import target_stop_ids
from dflash.engines.vllm_engine import build_llm, greedy_sampling, require_vllm, shutdown, token_prompts
from dflash.evaluation.evaluate import check_writable, eval_conversations, prompt_ids, run_eval, write_report
from dflash.evaluation.export import CONFIG_NAME, WEIGHTS_NAME, exported_folder, trained_target
from dflash.evaluation.serving import num_speculative_tokens
from dflash.kinds.record import DraftKind
from dflash.kinds.registry import kind_of_export
from dflash.run.folder import ENGINE_REPORT_NAME, new_report_path
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.loading import load_tokenizer, target_location, target_positions

log = logging.getLogger(__name__)

WHY = "dflash eval --engine vllm"
_GPU_ONLY = ("vLLM serves a {name} draft on GPUs only: vLLM 0.32's V1 model runner (the one a CPU runs) refuses "
             "{refusal}, and its V2 runner, which serves them, needs Triton on a GPU; evaluate it here without "
             "--engine, or with --engine vllm on a GPU machine")
_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_refusal(kind: DraftKind, device: torch.device) -> str | None:
    """Why vLLM cannot serve a draft of `kind` on `device`, None when it can: anywhere, the kind's own reason
    (`Serving.vllm_unservable`); on a CPU, what vLLM's V1 runner says refusing it (`Serving.vllm_cpu_refusal`)."""
    if kind.serving.vllm_unservable is not None:
        return (f"vLLM cannot serve a {kind.title} draft ({kind.serving.vllm_unservable}); serve it with SGLang (`dflash export` "
                "prints the line)")
    if device.type == "cpu" and kind.serving.vllm_cpu_refusal is not None:
        return _GPU_ONLY.format(name=kind.title, refusal=kind.serving.vllm_cpu_refusal)
    return None


def speculative_config(export_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `speculative_config` for the export (the line `dflash export` prints): method and proposal count."""
    kind = kind_of_export(config)
    return {"method": kind.serving.vllm_method, "model": str(export_dir),
            "num_speculative_tokens": num_speculative_tokens(config["block_size"], kind)}


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (totals over a run's requests): `drafts` verification steps that
    carried drafts, `draft_tokens` proposed, `accepted_tokens` accepted, `accepted_per_position[k]` steps that
    accepted draft position k + 1."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts since `before` (the engine's counters are cumulative)."""
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted_tokens - before.accepted_tokens,
                            _elementwise(self.accepted_per_position, before.accepted_per_position, -1))


def _elementwise(a: Sequence[int], b: Sequence[int], sign: int) -> list[int]:
    """a + sign * b, the shorter padded with zeros."""
    n = max(len(a), len(b))
    return [x + sign * y for x, y in zip([*a, *[0] * (n - len(a))], [*b, *[0] * (n - len(b))], strict=True)]


def read_counters(metrics: Sequence[Any]) -> SpecCounters:
    """`SpecCounters` from `LLM.get_metrics()` (summed over engines; absent counters read 0)."""
    from vllm.v1.metrics.reader import Counter, Vector  # optional: vLLM is imported by `build_llm` before this runs

    counts = SpecCounters()
    for metric in metrics:
        if isinstance(metric, Counter) and metric.name in _COUNTERS:
            name = _COUNTERS[metric.name]
            setattr(counts, name, getattr(counts, name) + metric.value)
        elif isinstance(metric, Vector) and metric.name == _PER_POSITION:
            counts.accepted_per_position = _elementwise(counts.accepted_per_position, metric.values, 1)
    return counts


def acceptance(counts: SpecCounters, new_tokens: int, num_prompts: int) -> dict[str, Any]:
    """The acceptance figures of a speculative run from its counters (module doc); `new_tokens` over all
    `num_prompts` outputs, stop tokens included."""
    drafts = counts.drafts
    return {
        "mean_acceptance_length": 1 + counts.accepted_tokens / drafts if drafts else float("nan"),
        "emitted_per_step": (new_tokens - num_prompts) / drafts if drafts else float("nan"),
        "per_position_acceptance": [n / drafts if drafts else float("nan") for n in counts.accepted_per_position],
        **asdict(counts),
    }


def lossless_check(greedy: Sequence[Sequence[int]], speculative: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Speculative outputs against the greedy ones, token for token: how many are identical, and the first
    difference of each other prompt (`prompt`, `position`, each engine's token there; None past an output's end)."""
    mismatches = []
    for i, (g, s) in enumerate(zip(greedy, speculative, strict=True)):
        if list(g) != list(s):
            pos = next((k for k, (a, b) in enumerate(zip(g, s, strict=False)) if a != b), min(len(g), len(s)))
            mismatches.append({"prompt": i, "position": pos, "greedy": g[pos] if pos < len(g) else None,
                               "speculative": s[pos] if pos < len(s) else None})
    return {"lossless": not mismatches, "identical_outputs": len(greedy) - len(mismatches), "mismatches": mismatches}


def vllm_decode(location: str, prompts: Sequence[Sequence[int]], stops: Sequence[int], *, max_new_tokens: int,
                dtype: torch.dtype, device: torch.device, spec: dict[str, Any] | None,
                positions: int | None = None) -> dict[str, Any]:
    """One engine's greedy outputs of `prompts` (one batch): `outputs` (token ids, a stop token kept), `seconds`
    of `generate`, `start_seconds` of the engine start, and with a `spec` (vLLM's speculative_config) the
    `counters` of this run. `positions`: the target's (vLLM refuses a longer max_model_len). The engine is shut
    down before returning (the next one needs the memory)."""
    # Room for two steps past the budget: a request's last verification may accept drafts past it, and the draft
    # then queries a block after those. With less, vLLM 0.32 (CPU, batched requests) lets the draft of a request
    # at the end of its room write into the draft KV cache of other requests: their acceptance changed from step to
    # step and from run to run (142 drafts with 2 steps of room, 143 with 1.25, 151 and 158 with one step; lossless
    # all the same, the target's verification is untouched).
    width = spec["num_speculative_tokens"] + 1 if spec else 1
    room = max(map(len, prompts)) + max_new_tokens + 2 * width
    start = time.perf_counter()
    llm = build_llm(location, dtype=dtype, device=device, why=WHY, speculative_config=spec, log_stats=spec is not None,
                    max_model_len=min(room, positions) if positions else room)
    try:
        started = time.perf_counter()
        before = read_counters(llm.get_metrics()) if spec else None
        t0 = time.perf_counter()
        results = llm.generate(token_prompts(prompts), greedy_sampling(max_new_tokens, stops), use_tqdm=False)
        seconds = time.perf_counter() - t0
        outputs = [list(r.outputs[0].token_ids) for r in results]
        counters = read_counters(llm.get_metrics()).minus(before) if before is not None else None
    finally:
        shutdown(llm)
    return {"outputs": outputs, "seconds": seconds, "start_seconds": started - start, "counters": counters}


def kernel_ignores_layer_weights() -> bool:
    """Whether vLLM's `rms_norm` kernel here applies the first row of a stacked `[L, D]` weight to all L groups of
    an `[L, T, D]` input. vLLM's DFlash normalizes the context keys of every draft layer in one such call
    (`qwen3_dflash._normalize_context_k`); the CUDA kernel selects each layer's row (vllm#46761), the XPU kernel
    did not (vllm-project/vllm-xpu-kernels#573), and the CPU kernel of vllm-cpu 0.32.0 does not either."""
    from vllm import _custom_ops as ops  # optional: imported after `require_vllm`

    x = torch.ones(2, 1, 32)  # 32: a head width the kernel vectorizes (it refuses widths not a multiple of its vector)
    weight = torch.stack([torch.ones(32), torch.full((32,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    return not torch.allclose(out, x * weight[:, None, :], atol=1e-4)


def layer_k_norms_differ(export_dir: Path) -> bool:
    """Whether the export's draft layers have different `k_norm` weights (so a kernel that applies layer 0's to
    all of them computes other context keys)."""
    with safe_open(str(export_dir / WEIGHTS_NAME), "pt") as f:
        norms = [f.get_tensor(n) for n in sorted(n for n in f.keys() if n.endswith("self_attn.k_norm.weight"))]
    return any(not torch.equal(norms[0], n) for n in norms[1:])


def context_norm_caveat(export_dir: Path, device: torch.device, version: str) -> str | None:
    """A sentence when vLLM on this machine computes the draft's context keys with the wrong norms
    (`kernel_ignores_layer_weights` and `layer_k_norms_differ`), None otherwise."""
    if device.type != "cpu" or not layer_k_norms_differ(export_dir) or not kernel_ignores_layer_weights():
        return None
    return (f"vLLM {version}'s CPU rms_norm kernel applies draft layer 0's k_norm to the context keys of every draft "
            "layer (this export's layers have different ones): vLLM's acceptance here under-reads the draft; a 1-layer "
            "draft, or vLLM on a GPU, is not affected (the XPU kernel had the same fault: vllm-xpu-kernels#573)")


def _device_kind(device: str) -> torch.device:
    """The type of device `resolve_device(device)` gives, without its effects (it picks the CPU threads and logs
    them): a refusal is then the only line the command prints."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(torch.device(device).type)
    except RuntimeError:
        return resolve_device(device)  # its ValueError naming the valid devices


def _free_memory() -> None:
    """Return the memory of dflash's own evaluation before an engine measures what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engine_eval(draft_dir: str | Path, *, target: str | None = None, prompts: str = "auto", num_prompts: int = 20,
                    max_new_tokens: int = 128, device: str = "auto", dtype: str = "auto",
                    out: str | Path | None = None, held_out_size: int = 64) -> dict[str, Any]:
    """dflash's own evaluation (`run_eval`), then the export served by vLLM (module doc): one report, written as
    JSON to `out` (replaced), else beside the export as DRAFT/eval_vllm.json, or the first free eval_vllm-N.json
    when a report is there already (`new_report_path`: an earlier report is never replaced). A draft kind or
    device vLLM cannot serve is a ValueError before anything loads (`vllm_refusal`); so is a missing vLLM (its
    install line)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # vLLM's engine runs its own processes; every rank would start one
        raise ValueError(f"{WHY} runs in one process (vLLM starts its own workers), not under a launcher of "
                         f"{os.environ['WORLD_SIZE']} processes")
    export_dir = exported_folder(draft_dir)
    config = json.loads((export_dir / CONFIG_NAME).read_text())
    kind = kind_of_export(config)
    if (why := vllm_refusal(kind, _device_kind(device))) is not None:
        raise ValueError(why)
    dev = resolve_device(device)
    vllm = require_vllm(WHY)
    path = Path(out) if out else new_report_path(export_dir, ENGINE_REPORT_NAME)
    check_writable(path)  # the report comes after minutes of decoding: a bad --out fails now
    target = target or trained_target(export_dir) or "embedded"  # run_eval's rule, resolved once for both engines
    tokenizer = load_tokenizer(target)
    ids = prompt_ids(tokenizer, eval_conversations(prompts, export_dir, held_out_size), num_prompts)
    stops = target_stop_ids(target, tokenizer)
    torch_dtype = resolve_dtype(dtype, dev)

    own = run_eval(export_dir, target=target, prompts=prompts, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                   device=device, dtype=dtype, held_out_size=held_out_size, write=False)
    if own["num_prompts"] != len(ids):  # the same prompt rule on the same source: a difference is a bug
        raise RuntimeError(f"dflash decoded {own['num_prompts']} prompts, vLLM would decode {len(ids)}")
    _free_memory()
    location, spec = target_location(target), speculative_config(export_dir, config)
    log.info("vLLM %s: %d prompts x %d new tokens, greedy, then with %s", vllm.__version__, len(ids), max_new_tokens,
             json.dumps(spec))
    positions = target_positions(target)
    run = dict(max_new_tokens=max_new_tokens, dtype=torch_dtype, device=dev, positions=positions)
    greedy = vllm_decode(location, ids, stops, spec=None, **run)
    served = vllm_decode(location, ids, stops, spec=spec, **run)

    new_tokens = sum(map(len, served["outputs"]))
    spec_tps, base_tps = new_tokens / served["seconds"], sum(map(len, greedy["outputs"])) / greedy["seconds"]
    figures = acceptance(served["counters"], new_tokens, len(ids))
    report = {
        "engine": "vllm", "vllm_version": vllm.__version__, "kind": kind.name, "draft": str(export_dir), "target": target,
        "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."), "num_prompts": len(ids),
        "max_new_tokens": max_new_tokens, "speculative_config": spec,
        "vllm": {**figures, **lossless_check(greedy["outputs"], served["outputs"]), "new_tokens": new_tokens,
                 "speculative_tokens_per_s": spec_tps, "target_tokens_per_s": base_tps, "speedup": spec_tps / base_tps,
                 "engine_start_s": {"greedy": greedy["start_seconds"], "speculative": served["start_seconds"]}},
        "dflash": own,
        # the two figures side by side: vLLM's own over dflash's own, on the same prompts and budget
        "acceptance_ratio": figures["mean_acceptance_length"] / own["tau"],
        "caveats": [c for c in [context_norm_caveat(export_dir, dev, vllm.__version__)] if c],
    }
    write_report(report, out, export_dir, ENGINE_REPORT_NAME)
    return report


def _rates(rates: Sequence[float]) -> str:
    return " ".join(f"{x:.2f}" for x in rates)


def format_engine_report(r: dict[str, Any]) -> str:
    """The report as the CLI prints it: each figure with whose it is."""
    v, d = r["vllm"], r["dflash"]
    checked = (f"lossless: {v['identical_outputs']}/{r['num_prompts']} outputs identical to vLLM's own greedy"
               if v["lossless"] else
               f"NOT LOSSLESS: {len(v['mismatches'])}/{r['num_prompts']} outputs differ from vLLM's own greedy "
               f"(first: {v['mismatches'][0]})")
    lines = [
        f"vLLM {r['vllm_version']} ({r['device']}, {r['dtype']}), {r['num_prompts']} prompts x {r['max_new_tokens']} "
        f"new tokens, speculative_config {json.dumps(r['speculative_config'])}",
        f"vLLM's mean acceptance length {v['mean_acceptance_length']:.3f} (its counters: 1 + {v['accepted_tokens']} "
        f"accepted / {v['drafts']} drafts); {v['emitted_per_step']:.3f} tokens per step cut at the budget as tau is",
        f"dflash's own tau {d['tau']:.3f} on the same prompts and budget (vLLM / dflash {r['acceptance_ratio']:.3f})",
        f"per-position acceptance, vLLM:   {_rates(v['per_position_acceptance'])}",
        f"per-position acceptance, dflash: {_rates(d['per_position_acceptance'])}",
        checked,
        f"tokens/s, vLLM (the prompts as one batch): {v['speculative_tokens_per_s']:.1f} speculative vs "
        f"{v['target_tokens_per_s']:.1f} greedy (x{v['speedup']:.2f}); dflash (one prompt at a time): "
        f"{d['speculative_tokens_per_s']:.1f} vs {d['target_tokens_per_s']:.1f} (x{d['speedup']:.2f})",
    ]
    return "\n".join(lines + [f"caveat: {c}" for c in r["caveats"]])
