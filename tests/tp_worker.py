"""Run by tests/test_tensor_parallel.py under `python -m torch.distributed.run` (CPU, gloo).

    python tests/tp_worker.py checks OUT DIR   2 ranks, tp = 2: every check of the tensor-parallel target
                                               against the single-process FrozenTarget (tiny Llama, Qwen3
                                               and Qwen2; tied / untied; biases; layer subsets; batches
                                               4, 3 and 1; the three schedules), the group-batch path,
                                               parameter bytes, sync findings, errors, sharded loading of
                                               checkpoints saved under DIR; then training, the lockstep
                                               decode and a whole `fit()` under tensor_parallel.size=2
                                               (tests/tp_training_checks.py).
    python tests/tp_worker.py mesh OUT         4 ranks, a (dp x tp) = 2 x 2 mesh: each rank's own rows of
                                               the group batch against the single-process target, and two
                                               training steps.

Each rank measures; rank 0 writes `{rank: results}` to OUT (torch.save). The test asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from helpers import make_tiny_target  # noqa: E402
from tp_training_checks import decode_checks, fit_checks, mesh_training_checks, training_checks  # noqa: E402

import dflash.target_model.tp_overlap as tp_overlap  # noqa: E402
from dflash.diagnostics import forbid_syncs  # noqa: E402
from dflash.target_model.frozen import FrozenTarget  # noqa: E402
from dflash.target_model.tensor_parallel import TensorParallelTarget, target_parameter_bytes, tp_mesh  # noqa: E402
from dflash.target_model.tp_group import GroupBatchTarget  # noqa: E402
from dflash.target_model.tp_overlap import SCHEDULES, gather_group_batch  # noqa: E402

VOCAB = 128
SEQ = 24


def tiny_model(kind: str, *, tied: bool = False, bias: bool = False, heads: int = 4, kv_heads: int = 2,
               seed: int = 0) -> nn.Module:
    """A 4-layer, hidden-64 causal LM of `kind` (llama / qwen3 / qwen2) whose every weight matters:
    linears ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1), embedding and head ~ N(0, 1)."""
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=tied)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=bias, mlp_bias=bias))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, attention_bias=bias))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))  # q/k/v biases
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, max abs difference / max abs value)."""
    d = (a - b).abs().max().item()
    return d, d / b.abs().max().item()


CASES = {  # name: (builder, layer ids)
    "llama_conftest": (lambda: make_tiny_target(), [0, 2]),
    "llama_untied": (lambda: tiny_model("llama"), [0, 1, 2, 3]),
    "llama_tied_bias": (lambda: tiny_model("llama", tied=True, bias=True), [3]),
    "qwen3_untied": (lambda: tiny_model("qwen3"), [1, 2]),
    "qwen3_tied": (lambda: tiny_model("qwen3", tied=True), [0, 3]),
    "qwen2_tied": (lambda: tiny_model("qwen2", tied=True), [2]),
}


def equality_checks(mesh: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Per case and batch size: features, last hidden and greedy labels of every schedule against
    FrozenTarget; overlap vs split (bitwise) and vs unsplit."""
    out: dict[str, Any] = {}
    for name, (build, layers) in CASES.items():
        ref_model = build()
        ref = FrozenTarget(ref_model, layers)
        tp = TensorParallelTarget(build(), layers, mesh)
        for batch in (4, 3, 1):
            x = ids[:batch]
            want_feats, want_greedy = ref.features_and_greedy(x)
            want_last = ref_model.model(input_ids=x).last_hidden_state
            results = {}
            for schedule in SCHEDULES:
                tp.schedule = schedule
                feats = tp(x)
                g_feats, greedy = tp.features_and_greedy(x)
                _, last = tp.hidden_states(x, all_layers=True)
                results[schedule] = feats
                out[f"{name}/b{batch}/{schedule}"] = {
                    "features": rel_diff(feats, want_feats), "features_greedy_path": rel_diff(g_feats, want_feats),
                    "last_hidden": rel_diff(last, want_last), "greedy_equal": torch.equal(greedy, want_greedy),
                    "shape_ok": feats.shape == want_feats.shape}
            out[f"{name}/b{batch}/overlap_vs_split_bitwise"] = torch.equal(results["overlap"], results["split"])
            out[f"{name}/b{batch}/overlap_vs_unsplit"] = (results["overlap"] - results["unsplit"]).abs().max().item()
        tp.schedule = "overlap"
        if name == "llama_tied_bias":
            out["tied_head_is_embedding"] = tp.lm_head_weight is tp.embed_weight
            try:
                tp.model(input_ids=ids[:1])
                out["model_forward_refused"] = "no error"
            except RuntimeError as exc:
                out["model_forward_refused"] = str(exc)
        if name == "llama_untied":
            out["memory"] = {"tp": target_parameter_bytes(tp), "replicated": target_parameter_bytes(ref)}
            out["syncs"] = sync_findings(tp, ids)
            out["group"] = group_checks(tp, ref, ids)
            out["trace"] = {schedule: schedule_trace(tp, ids[:4], schedule) for schedule in SCHEDULES}
    return out


def schedule_trace(tp: TensorParallelTarget, ids: torch.Tensor, schedule: str) -> list[tuple[Any, ...]]:
    """The order of compute stages, all-reduce issues (`async_op`) and waits in one forward:
    ("compute",), ("issue", n, async), ("wait", n)."""
    events: list[tuple[Any, ...]] = []
    real = tp_overlap.attention_partial, tp_overlap.mlp_partial, dist.all_reduce

    class LoggedWork:
        def __init__(self, work: dist.Work, n: int) -> None:
            self.work, self.n = work, n

        def wait(self) -> bool:
            events.append(("wait", self.n))
            return self.work.wait()

    def all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        n = sum(e[0] == "issue" for e in events)
        events.append(("issue", n, async_op))
        work = real[2](tensor, *args, async_op=async_op, **kwargs)
        return LoggedWork(work, n) if async_op else work

    def logged(fn: Any) -> Any:
        def call(*args: Any) -> torch.Tensor:
            events.append(("compute",))
            return fn(*args)
        return call

    tp.schedule = schedule
    tp_overlap.attention_partial, tp_overlap.mlp_partial = logged(real[0]), logged(real[1])
    dist.all_reduce = all_reduce
    try:
        tp(ids)
    finally:
        tp_overlap.attention_partial, tp_overlap.mlp_partial, dist.all_reduce = real
        tp.schedule = "overlap"
    return events


def sync_findings(tp: TensorParallelTarget, ids: torch.Tensor) -> dict[str, list[str]]:
    """What forbid_syncs reports for the TP forward (every schedule), its greedy path and the group
    path (gloo collectives included), and for a planted `.item()` (the detector works here)."""
    found: dict[str, list[str]] = {}
    for schedule in SCHEDULES:
        tp.schedule = schedule
        with forbid_syncs(raise_on_first=False) as report:
            tp(ids)
            tp.features_and_greedy(ids)
        found[schedule] = [str(f) for f in report.findings]
    tp.schedule = "overlap"
    group = GroupBatchTarget(tp)
    own = (ids[:2] + dist.get_rank()) % VOCAB  # different rows on each rank
    with forbid_syncs(raise_on_first=False) as report:
        group(own)
        group.features_and_greedy(own)
    found["group"] = [str(f) for f in report.findings]
    with forbid_syncs(raise_on_first=False) as report:
        tp(ids).sum().item()
    found["planted_item"] = [f.op for f in report.findings]
    return found


def group_checks(tp: TensorParallelTarget, ref: FrozenTarget, ids: torch.Tensor) -> dict[str, Any]:
    """Each rank's own micro-batch through `GroupBatchTarget` against the single-process target on
    the concatenated batch (rows of this rank), for micro-batches of 2 rows and of 1 row."""
    rank, out = dist.get_rank(), {}
    group = GroupBatchTarget(tp)
    for rows_per_rank in (2, 1):
        whole = ids[: 2 * rows_per_rank]
        mine = whole[rank * rows_per_rank : (rank + 1) * rows_per_rank]
        gathered = gather_group_batch(mine, tp.group)
        want_feats, want_greedy = ref.features_and_greedy(whole)
        want_feats, want_greedy = (t[rank * rows_per_rank : (rank + 1) * rows_per_rank] for t in (want_feats, want_greedy))
        feats = group(mine)
        g_feats, greedy = group.features_and_greedy(mine)
        out[f"rows{rows_per_rank}"] = {"gathered_equal": torch.equal(gathered, whole),
                                       "features": rel_diff(feats, want_feats),
                                       "features_greedy_path": rel_diff(g_feats, want_feats),
                                       "greedy_equal": torch.equal(greedy, want_greedy),
                                       "shape": tuple(feats.shape)}
    # Ranks of different lengths (each collator pads to its own bucket): padded to `length` for the gather.
    padded = GroupBatchTarget(tp, length=SEQ)
    mine = ids[2 * rank : 2 * rank + 2, : SEQ - 8 * rank]  # rank 0: 24 tokens, rank 1: 16
    want_feats, want_greedy = ref.features_and_greedy(mine)
    feats = padded(mine)
    g_feats, greedy = padded.features_and_greedy(mine)
    out["padded"] = {"gathered_equal": True, "features": rel_diff(feats, want_feats),
                     "features_greedy_path": rel_diff(g_feats, want_feats), "greedy_equal": torch.equal(greedy, want_greedy),
                     "shape": tuple(feats.shape), "length": mine.shape[1]}
    return out


def error_checks(mesh: Any) -> dict[str, str]:
    """The messages of bad settings raised inside a real 2-rank group."""
    errors = {}
    for label, make in (("kv_heads", lambda: TensorParallelTarget(tiny_model("llama", kv_heads=1), [0], mesh)),
                        ("world", lambda: tp_mesh(3, "cpu")),
                        ("schedule", lambda: TensorParallelTarget(tiny_model("llama"), [0], mesh, schedule="bad")),
                        ("layers", lambda: TensorParallelTarget(tiny_model("llama"), [4], mesh))):
        try:
            make()
            errors[label] = "no error"
        except ValueError as exc:
            errors[label] = str(exc)
    return errors


def loading_checks(mesh: Any, folder: Path, ids: torch.Tensor) -> dict[str, Any]:
    """`from_pretrained` (each rank reads its slices) of checkpoints saved by rank 0: a tied Qwen3 in
    one safetensors file, a biased untied Llama split over several files (an index)."""
    saved = {"qwen3_tied": (tiny_model("qwen3", tied=True, seed=3), [1, 3], {}),
             "llama_bias_sharded": (tiny_model("llama", bias=True, seed=4), [0, 2], {"max_shard_size": "50KB"})}
    if dist.get_rank() == 0:
        for name, (model, _, kwargs) in saved.items():
            model.save_pretrained(folder / name, **kwargs)
    dist.barrier()
    out = {}
    for name, (_, layers, _) in saved.items():
        path = folder / name
        ref = FrozenTarget(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), layers)
        tp = TensorParallelTarget.from_pretrained(path, layers, mesh, dtype=torch.float32, device=torch.device("cpu"))
        want_feats, want_greedy = ref.features_and_greedy(ids)
        feats, greedy = tp.features_and_greedy(ids)
        attn = tp.model.get_decoder().layers[0].self_attn
        out[name] = {"features": rel_diff(feats, want_feats), "greedy_equal": torch.equal(greedy, want_greedy),
                     "q_proj_shape": tuple(attn.q_proj.weight.shape), "o_proj_shape": tuple(attn.o_proj.weight.shape),
                     "files": len(list(path.glob("*.safetensors"))), "tied": tp.lm_head_weight is tp.embed_weight,
                     "memory": target_parameter_bytes(tp)}
    return out


def mesh_checks(ids: torch.Tensor) -> dict[str, Any]:
    """A (dp x tp) = 2 x 2 mesh on 4 ranks: rank r's own 2 rows of the global batch `[8, S]`."""
    mesh = tp_mesh(2, "cpu")
    rank = dist.get_rank()
    build, layers = CASES["qwen3_untied"]
    ref = FrozenTarget(build(), layers)
    tp = TensorParallelTarget(build(), layers, mesh)
    group = GroupBatchTarget(tp)
    mine = ids[2 * rank : 2 * rank + 2]
    want_feats, want_greedy = ref.features_and_greedy(ids)
    feats, greedy = group.features_and_greedy(mine)
    return {"tp_rank": tp.tp_rank, "dp_rank": mesh.get_local_rank("dp"),
            "features": rel_diff(feats, want_feats[2 * rank : 2 * rank + 2]),
            "greedy_equal": torch.equal(greedy, want_greedy[2 * rank : 2 * rank + 2]),
            "group_batch": tuple(gather_group_batch(mine, tp.group).shape)}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(7))
    if mode == "checks":
        mesh = tp_mesh(2, "cpu")
        results = {"equality": equality_checks(mesh, ids), "errors": error_checks(mesh),
                   "loading": loading_checks(mesh, Path(sys.argv[3]), ids[:4]), "training": training_checks(),
                   "decode": decode_checks(mesh), "fit": fit_checks(Path(sys.argv[3]))}
    else:
        results = {**mesh_checks(ids), "training": mesh_training_checks()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        torch.save(dict(enumerate(gathered)), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
