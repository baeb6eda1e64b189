"""How much neighbouring queries' selections overlap: the distinct selection blocks a tile of consecutive queries
touches per KV group (Eq. 11's indices), against the n blocks each query gathers on its own.

A query-centric selected kernel loads n blocks of l' keys per (query, KV group); a kernel that took a tile of q
consecutive queries at once would load the union of their blocks once and compute every query of the tile against
every key of that union (masking the pairs not selected). This probe measures that union on the selections Eq. 8-11
make (optimized.stages.selection_indices) for the random inputs `python -m perf run` times, so the two costs can be
compared: loads per query (union / q against n) and the share of computed (query, key) pairs that are
selected (n / union). Rows that have no choice (t < n l', every visible block selected) are left out.

    python -m perf.selection_overlap [--preset paper] [--seq-len 8192] [--tiles 1,16,64] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from reference.config import NSAConfig

from .cases import single_sequence_inputs
from .cli import parse_seq_lens
from .env import describe
from .spec import PRESETS, BenchSpec, preset


def union_sizes(indices: torch.Tensor, tile: int, first_row: int = 0) -> torch.Tensor:
    """Distinct valid blocks (>= 0) of each (tile of `tile` consecutive rows from first_row on, KV group):
    indices [T, Hkv, n] -> int64 [tiles, Hkv] (a last, partial tile is left out)."""
    T, Hkv, n = indices.shape
    tiles = (T - first_row) // tile
    rows = indices[first_row:first_row + tiles * tile].reshape(tiles, tile, Hkv, n).permute(0, 2, 1, 3)
    rows = rows.reshape(tiles, Hkv, tile * n).sort(dim=-1).values
    new = torch.ones_like(rows, dtype=torch.bool)
    new[..., 1:] = rows[..., 1:] != rows[..., :-1]
    return (new & (rows >= 0)).sum(-1)


def benchmark_selections(spec: BenchSpec, T: int, seed: int, device: torch.device) -> torch.Tensor:
    """Eq. 8-11 indices [T, Hkv, n] of the first sequence of the inputs `python -m perf run` draws for this sweep
    (perf.cases.single_sequence_inputs: standard normal q and k, the sweep's dtype, a random phi MLP where the
    config's phi is mlp), from the selection stage on its own (optimized.stages.selection_indices over
    optimized.compression.compress; nsa_forward hands it the compressed branch's softmax instead, which may round a
    near tie the other way)."""
    from optimized.compression import compress
    from optimized.stages import selection_indices

    x = single_sequence_inputs(spec, T, device, seed)
    k_cmp, _ = compress(x.kv.cmp.k, x.kv.cmp.v, spec.cfg, x.phi)
    return selection_indices(x.q, k_cmp, spec.cfg)[0]


def overlap_rows(indices: torch.Tensor, cfg: NSAConfig, tiles: list[int]) -> list[dict]:
    """One row per tile size: mean distinct blocks per (tile, KV group), the mean blocks visible to a tile's last
    query (all a tile could touch), distinct blocks per query, and the selected share of the union's (query, key)
    pairs, over the rows with a choice."""
    first = min(cfg.n_sel * cfg.sel_block, indices.shape[0])
    out = []
    for tile in tiles:
        sizes = union_sizes(indices, tile, first).double()
        mean = float(sizes.mean()) if sizes.numel() else float("nan")
        last_rows = first + tile * torch.arange(1, sizes.shape[0] + 1, dtype=torch.float64) - 1
        visible = float((last_rows // cfg.sel_block + 1).mean()) if sizes.numel() else float("nan")
        out.append({"tile": tile, "tiles": int(sizes.shape[0]), "distinct_blocks": mean,
                    "visible_blocks": visible, "blocks_per_query": mean / tile,
                    "selected_share": cfg.n_sel / mean if mean else float("nan")})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=parse_seq_lens, default=(8192,), help="one T, e.g. 8k (default)")
    parser.add_argument("--tiles", default="1,16,64", help="comma-separated tile sizes (queries)")
    parser.add_argument("--preset", choices=PRESETS, default="paper", help="the perf sweep whose inputs to score")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' seed (perf.cases.single_sequence_inputs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="also write selection_overlap.json here")
    args = parser.parse_args(argv)
    try:
        tiles = [int(t) for t in args.tiles.split(",")]
        if not tiles or min(tiles) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--tiles must be comma-separated positive integers, got {args.tiles!r}")
    if len(args.seq_len) != 1:
        parser.error("--seq-len takes one length")
    T = args.seq_len[0]
    spec = preset(args.preset)
    cfg = spec.cfg
    start = time.perf_counter()
    indices = benchmark_selections(spec, T, args.seed, torch.device(args.device))
    rows = overlap_rows(indices, cfg, tiles)
    print(f"selection_overlap: the {args.preset} sweep's inputs, T = {T}, n = {cfg.n_sel}, l' = {cfg.sel_block} "
          f"({time.perf_counter() - start:.1f} s)")
    for row in rows:
        print(f"  tile {row['tile']:4d}: {row['distinct_blocks']:7.1f} distinct blocks per (tile, KV group) of "
              f"{row['visible_blocks']:.1f} visible, {row['blocks_per_query']:6.2f} per query, "
              f"{row['selected_share']:.1%} of the union's pairs selected")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"env": describe(torch.device(args.device)), "preset": args.preset, "seq_len": T,
                  "config": cfg.to_dict(), "dtype": spec.dtype, "seed": args.seed, "n_sel": cfg.n_sel,
                  "sel_block": cfg.sel_block, "rows": rows}
        (args.out / "selection_overlap.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
