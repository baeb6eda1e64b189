"""Where the NSA layer's time goes, kernel by kernel (a GPU diagnostic next to `perf run`'s stage rows).

Runs the perf runner's own layer case (perf.cases.build_nsa_case, paper preset, bf16, batch 1; the sweep's
d_k = d_v = 128 unless --head-dims says otherwise, e.g. 192,128 for the paper's own) for one implementation and pass
under torch.profiler, and reports for each GPU kernel its device time and launches per
layer call, and the layer's wall time (CUDA events) next to its summed device time: a wall time well above the
device time means the host (Python, launches, syncs) bounds the call, not the kernels.

    python -m perf.layer_profile --seq-lens 8k,64k [--pass fwd] [--impl "nsa[range_backend=torch]"]
                                 [--head-dims 192,128] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from pathlib import Path

import torch

from .cases import build_nsa_case, single_sequence_inputs
from .cli import parse_seq_lens
from .outputs import PERF_OUT, write_probe_report
from .implementations import parse_impls
from .spec import preset


def profile_case(impl, T: int, pass_name: str, calls: int, device: torch.device,
                 head_dims: tuple[int, int] | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    spec = preset("paper")
    if head_dims is not None:
        spec = spec.replace(cfg=dataclasses.replace(spec.cfg, head_dim_qk=head_dims[0], head_dim_v=head_dims[1]))
    inputs = single_sequence_inputs(spec, T, device, seed=0)
    run = build_nsa_case(impl, "layer", pass_name, inputs, spec, seed=0).run
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    for _ in range(calls):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time_total
            counts[event.name[:80]] += 1
    kernels = [{"kernel": name, "ms_per_call": t / calls / 1e3, "launches_per_call": counts[name] / calls}
               for name, t in sorted(totals.items(), key=lambda kv: -kv[1])]
    return {"seq_len": T, "pass": pass_name, "impl": impl.label,
            "head_dims": [spec.cfg.head_dim_qk, spec.cfg.head_dim_v], "wall_ms_median": sorted(walls)[len(walls) // 2],
            "device_ms_per_call": sum(totals.values()) / calls / 1e3,
            "launches_per_call": sum(counts.values()) / calls, "kernels": kernels}


def head_dims_arg(text: str) -> tuple[int, int]:
    """--head-dims DK,DV: two positive integers."""
    try:
        dk, dv = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--head-dims must be two integers DK,DV, got {text!r}") from None
    if dk < 1 or dv < 1:
        raise argparse.ArgumentTypeError(f"--head-dims must be positive, got {text!r}")
    return dk, dv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=parse_seq_lens, default=(8192, 65536))
    parser.add_argument("--pass", dest="pass_name", choices=("fwd", "fwd_bwd"), default="fwd")
    parser.add_argument("--impl", default="nsa", help="an --impls entry of `perf run` (default nsa: the defaults)")
    parser.add_argument("--head-dims", type=head_dims_arg, default=None, metavar="DK,DV",
                        help="the layer's d_k and d_v (default the paper sweep's 128,128)")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=PERF_OUT,
                        help="writes layer_profile_<pass>.json here (default reports/perf)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    _, (impl,), _ = parse_impls(args.impl, "optimized")
    results = []
    for T in args.seq_lens:
        r = profile_case(impl, T, args.pass_name, args.calls, device, args.head_dims)
        results.append(r)
        print(f"T={T} {args.pass_name} {impl.label}: wall {r['wall_ms_median']:.2f} ms, device "
              f"{r['device_ms_per_call']:.2f} ms in {r['launches_per_call']:.0f} launches per call", flush=True)
        for k in r["kernels"][:args.top]:
            print(f"  {k['ms_per_call']:9.3f} ms  {k['launches_per_call']:7.1f} x  {k['kernel']}", flush=True)
        torch.cuda.empty_cache()
    write_probe_report(args.out, f"layer_profile_{args.pass_name}",
                       f"torch.profiler device time summed over {args.calls} calls after 2 warm-up calls; wall: CUDA "
                       "events, median of the same number of calls (L2 not flushed)", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
