"""Read throughput of the two candidate storage formats for offline target features, on the CPU.

Writes the same random rows (default: 2,000 rows x 256 tokens x 2x576 bf16, the embedded target's
feature shapes) as (a) dflash's safetensors shards (`dflash.data.features.save_shard`, read through
`dflash.data.feature_data.FeatureDataset`: memory-mapped `safe_open` slices) and (b) Arrow through
`datasets` (`Dataset.from_dict(...).save_to_disk`, then `load_from_disk`, memory-mapped; bf16 kept as
its uint16 bits, Arrow has no bfloat16, and read zero-copy through pyarrow), then reads every row once
in a shuffled order (as training does) into a bf16 torch tensor and reports MB/s (feature bytes) and
rows/s of each. The files sit in the page cache after writing: this measures the formats' decoding
paths, not the disk.

    python scripts/bench_features.py [--rows 2000] [--tokens 256] [--dim 1152] [--dir DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch

from dflash.data.feature_data import FeatureDataset
from dflash.data.features import FORMAT_VERSION, MANIFEST, save_shard, shard_name, shard_tensors


def make_rows(num_rows: int, tokens: int, dim: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"features": torch.randn(tokens, dim, generator=g).to(torch.bfloat16),
             "input_ids": torch.randint(0, 49152, (tokens,), generator=g, dtype=torch.int64),
             "loss_mask": torch.ones(tokens, dtype=torch.uint8)} for _ in range(num_rows)]


def write_safetensors(rows: list[dict[str, torch.Tensor]], folder: Path, shard_rows: int) -> None:
    folder.mkdir(parents=True)
    shards = []
    for k, start in enumerate(range(0, len(rows), shard_rows)):
        part = rows[start : start + shard_rows]
        entry = save_shard(folder / shard_name(k), shard_tensors(part, start))
        entry.update(rows=[start, start + len(part)])
        shards.append(entry)
    header = {"version": FORMAT_VERSION, "num_rows": len(rows), "labels": False,
              "feature_dim": rows[0]["features"].shape[1]}
    (folder / MANIFEST).write_text(json.dumps({"header": header, "shards": shards}))


def write_arrow(rows: list[dict[str, torch.Tensor]], folder: Path) -> None:
    dim = rows[0]["features"].shape[1]
    features = datasets.Features({"features": datasets.Array2D(shape=(None, dim), dtype="uint16"),
                                  "input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("uint8"))})
    columns = {"features": [r["features"].view(torch.uint16).numpy() for r in rows],
               "input_ids": [r["input_ids"].to(torch.int32).numpy() for r in rows],
               "loss_mask": [r["loss_mask"].numpy() for r in rows]}
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(folder))


def read_all(get, order: list[int]) -> tuple[float, int]:
    """Seconds to read every row in `order`, and the feature bytes read."""
    total = 0
    start = time.perf_counter()
    for i in order:
        row = get(i)
        total += row.numel() * row.element_size()
    return time.perf_counter() - start, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dim", type=int, default=1152)
    parser.add_argument("--shard-rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=str, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-features-", dir=args.dir))
    try:
        rows = make_rows(args.rows, args.tokens, args.dim)
        write_safetensors(rows, root / "safetensors", args.shard_rows)
        write_arrow(rows, root / "arrow")
        del rows
        st = FeatureDataset(root / "safetensors")
        arrow = datasets.load_from_disk(str(root / "arrow")).with_format("arrow", columns=["features"])
        dim = args.dim

        def get_st(i: int) -> torch.Tensor:
            return st[i]["features"]

        def get_arrow(i: int) -> torch.Tensor:  # zero-copy through pyarrow (the numpy format upcasts to int64)
            bits = arrow[i]["features"].combine_chunks().storage.flatten().flatten().to_numpy()
            return torch.from_numpy(np.ascontiguousarray(bits).reshape(-1, dim)).view(torch.bfloat16)

        assert torch.equal(get_st(1), get_arrow(1)), "the two formats disagree"
        order = list(range(args.rows))
        random.Random(0).shuffle(order)
        best = {}
        for name, get in (("safetensors", get_st), ("arrow", get_arrow)):
            best[name] = min(read_all(get, order) for _ in range(args.repeats))
        mb = {name: total / seconds / 1e6 for name, (seconds, total) in best.items()}
        rps = {name: args.rows / seconds for name, (seconds, _) in best.items()}
        for name in best:
            print(f"{name}: {mb[name]:.0f} MB/s, {rps[name]:.0f} rows/s")
        winner = max(mb, key=mb.get)
        print(f"features read ({args.rows} rows x {args.tokens} tokens x {args.dim} bf16, shuffled, page cache): "
              f"safetensors {mb['safetensors']:.0f} MB/s ({rps['safetensors']:.0f} rows/s), "
              f"arrow {mb['arrow']:.0f} MB/s ({rps['arrow']:.0f} rows/s): {winner} faster")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
