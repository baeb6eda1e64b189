"""Is a float32 FAIL rounding luck or a real loss of precision? The error spread of a card's implementation over many
draws, beside a control implementation on the same draws.

    python -m conformance.spread fla-parallel --check gradients --draws 140 --out DIR [--branch slc]
    python -m conformance.spread fla-parallel --check large_logits --draws 280 --out DIR

An implementation that computes in float32 is judged by FlashAttention's error-ratio rule against the reference
run in float32 (conformance/precision.py). One draw over budget may be rounding luck: the reference's own float32
error is a single sample. Over many draws the question has an answer. A correct float32 implementation (the control,
default `optimized`: this project's kernels, given float32 inputs) shows how often rounding alone exceeds the
budget; an implementation whose ratios sit well above the control's, on most draws, loses precision the rule is
right to report.

Checks, each on the card's conventions and sizes (its envelope), inputs as the suite draws them:
- gradients: the low-precision gradient test at float32 (every block selected, so that no near-tie changes what is
  attended): the output and the gradient of every input, budget 2 x the reference's float32 error + 1e-6.
- large_logits: the large-logit test (logits near +-1e5, every block selected): o_cmp, o_slc, o, budget as above
  plus the logit-rounding floor (precision.logit_rounding_floor); the ratio without the floor is listed too.

Writes DIR/spread-<card>-<check>[-<branch>].csv (one row per draw and field) and .md (per field: median, 90th
percentile, largest ratio and draws over budget, implementation and control). Draws are seeded (--seed)."""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

from conformance.adapters import load_impl
from conformance.cards import CARDS
from conformance.conventions import checked_conventions
from conformance.helpers import inputs_for, max_abs_error, output_and_grads
from conformance.precision import ATOL, error_budget
from conformance.strategies import CPU_SIZES, CUDA_SIZES, Envelope, use_sizes
from reference.contract import BRANCHES

CHECKS = ("gradients", "large_logits")


def card_envelope(card_name: str):
    """(implementation, envelope, device) of a card: its adapter inside its own conventions."""
    card = CARDS[card_name]
    impl = load_impl(card.impl)
    device = torch.device(card.device)
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    use_sizes(sizes)
    return impl, Envelope(checked_conventions(card.preset, None, list(card.sets)).config, impl.caps, sizes), device


def draw_config(envelope: Envelope, T: int, n_kv: int):
    """Small sizes inside the envelope (as the gradient tests' tiny config), every block of T selected."""
    base = envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=2, n_init=1, n_local=1,
                                        window=3, n_heads=2 * n_kv, n_kv_heads=n_kv, head_dim_qk=4, head_dim_v=4,
                                        phi="avg" if "avg" in envelope.caps.phi else "mlp")
    cfg = envelope.fit(base, equal_block=2)
    every = envelope.caps.n_sel.smallest(1, at_least=max(cfg.n_sel, -(-T // cfg.sel_block)))
    return cfg.replace(n_sel=every[0]) if every else None


def gradient_fields(impl, control, cfg, T, seed, device, branch):
    """{field: (impl error, control error, reference float32 error, floor)} of one draw of the gradient check."""
    reference = load_impl("reference")
    x = inputs_for(impl, cfg, T, seed=seed)
    if branch:
        with torch.no_grad():
            x.gates.zero_()
            x.gates[..., BRANCHES.index(branch)] = 1.0
    weights = torch.randn((1, T, cfg.n_heads, cfg.head_dim_v), generator=torch.Generator().manual_seed(seed),
                          dtype=torch.float64).float().double()
    low = x.to(dtype=torch.float32)

    def forward(f):
        return lambda y: f.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi)

    o64, g64 = output_and_grads(forward(reference), low.to(dtype=torch.float64), weights)
    o32, g32 = output_and_grads(forward(reference), low, weights)
    runs = [output_and_grads(forward(f), low.to(device=device), weights) for f in (impl, control)]
    taken = torch.tensor([float(b in impl.caps.branches) for b in BRANCHES], dtype=torch.float64)

    def error(g: dict, name: str) -> float:  # gates of branches the implementation lacks are not compared
        mask = taken if name == "gates" else torch.ones(())
        return max_abs_error(g[name] * mask.to(g[name]), g64[name] * mask.to(g64[name]))

    out = {"o": tuple(max_abs_error(r[0].o, o64.o) for r in runs) + (max_abs_error(o32.o, o64.o), 0.0)}
    for name in g64:
        out[f"d{name}"] = tuple(error(r[1], name) for r in runs) + (error(g32, name), 0.0)
    return out


def large_logit_fields(impl, control, cfg, T, seed, device, sign):
    """{field: (impl error, control error, reference float32 error, logit-rounding floor)} of one draw of the
    large-logit check (logits near sign * 1e5, every block selected)."""
    from conformance.helpers import large_logit_floor, large_logit_inputs

    reference = load_impl("reference")
    x = large_logit_inputs(cfg, T, seed, sign, "cpu", impl.shared_kv, impl.caps)
    ref64 = reference.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    y = x.to(dtype=torch.float32)
    ref32 = reference.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi)
    z = y.to(device=device)
    runs = [f.nsa_forward(z.q, z.kv, z.gates, cfg, z.phi) for f in (impl, control)]
    fields = [f for f in ("o_cmp", "o_slc", "o_win") if f[2:] in impl.caps.branches] + ["o"]
    return {f: tuple(max_abs_error(getattr(r, f), getattr(ref64, f)) for r in runs)
            + (max_abs_error(getattr(ref32, f), getattr(ref64, f)), large_logit_floor(x, f, torch.float32))
            for f in fields}


def describe_device(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{name}, torch {torch.__version__}"


def command_line(argv: list[str]) -> str:
    """The command that made a summary, its output folder written DIR."""
    args = ["DIR" if i and argv[i - 1] == "--out" else "--out=DIR" if a.startswith("--out=") else a
            for i, a in enumerate(argv)]
    return " ".join(["python -m conformance.spread", *args])


def summary(rows: list[dict], card: str, check: str, branch: str | None, control: str, seconds: float,
            device: str, command: str) -> str:
    fields = list(dict.fromkeys(r["field"] for r in rows))
    draws = len({r["draw"] for r in rows})
    floors = any(r["floor"] for r in rows)
    lines = [f"# Error spread: {card}, {check}" + (f", gates on the {branch} branch only" if branch else ""),
             "", f"`{command}`", "",
             f"{draws} draws in {seconds:.0f} s on {device}; control `{control}` on the same float32 inputs. Ratio = "
             f"error against the float64 reference / (2 x the reference's float32 error + {ATOL:g}"
             + (" + logit-rounding floor" if floors else "") + "); a ratio above 1 fails the suite's check.", "",
             "| field | implementation: median / p90 / max ratio | over 1 | control: median / p90 / max ratio "
             "| over 1 |" + (" implementation / control over 1 without the floor |" if floors else ""),
             "|---|---|---|---|---|" + ("---|" if floors else "")]

    def stats(values):
        v = sorted(values)
        return f"{statistics.median(v):.2f} / {v[int(0.9 * (len(v) - 1))]:.2f} / {v[-1]:.2f}", sum(x > 1 for x in v)

    for f in fields:
        sel = [r for r in rows if r["field"] == f]
        (si, ni), (sc, nc) = stats([r["impl_ratio"] for r in sel]), stats([r["control_ratio"] for r in sel])
        line = f"| {f} | {si} | {ni}/{len(sel)} | {sc} | {nc}/{len(sel)} |"
        if floors:
            line += (f" {sum(r['impl_ratio_no_floor'] > 1 for r in sel)} / "
                     f"{sum(r['control_ratio_no_floor'] > 1 for r in sel)} |")
        lines.append(line)
    lines += ["", "Per-draw errors: the CSV beside this file (impl_error, control_error, reference_error: max |x - "
              "float64 reference|; floor; ratios)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.spread", description=__doc__.split("\n\n")[0])
    parser.add_argument("card", choices=sorted(CARDS), help="the card whose implementation and conventions to use")
    parser.add_argument("--check", choices=CHECKS, required=True)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--branch", choices=BRANCHES, help="gradients: gates 1 on this branch, 0 on the others")
    parser.add_argument("--control", default="optimized", help="a correct implementation run on the same draws")
    parser.add_argument("--max-t", type=int, default=40, help="longest sequence drawn (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, metavar="DIR")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.draws < 1 or args.max_t < 2:
        parser.error("--draws must be at least 1 and --max-t at least 2")
    if args.branch and args.check != "gradients":
        parser.error("--branch applies to --check gradients")
    impl, envelope, device = card_envelope(args.card)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"conformance.spread: card {args.card} runs on CUDA and no CUDA device is visible", file=sys.stderr)
        return 2
    control = load_impl(args.control)
    rng = torch.Generator().manual_seed(args.seed)
    kv_options = envelope.caps.kv_heads.within((1, 2))
    rows, start = [], time.time()
    for draw in range(args.draws):
        T = int(torch.randint(2, args.max_t + 1, (1,), generator=rng))
        n_kv = kv_options[int(torch.randint(0, len(kv_options), (1,), generator=rng))]
        seed = int(torch.randint(0, 2**20, (1,), generator=rng))
        sign = (-1.0, 1.0)[draw % 2]
        cfg = draw_config(envelope, T, n_kv)
        if cfg is None:
            continue
        if args.check == "gradients":
            fields = gradient_fields(impl, control, cfg, T, seed, device, args.branch)
        else:
            fields = large_logit_fields(impl, control, cfg, T, seed, device, sign)
        for f, (e_impl, e_ctrl, e_ref, floor) in fields.items():
            budget, with_floor = error_budget(e_ref), error_budget(e_ref, floor)
            rows.append(dict(draw=draw, T=T, n_kv_heads=n_kv, seed=seed, sign=sign if args.check == "large_logits"
                             else "", field=f, impl_error=e_impl, control_error=e_ctrl, reference_error=e_ref,
                             floor=floor, impl_ratio=e_impl / with_floor, control_ratio=e_ctrl / with_floor,
                             impl_ratio_no_floor=e_impl / budget, control_ratio_no_floor=e_ctrl / budget))
    if not rows:
        print(f"conformance.spread: no draw fits card {args.card}'s envelope", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"spread-{args.card}-{args.check}" + (f"-{args.branch}" if args.branch else ""))
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = summary(rows, args.card, args.check, args.branch, args.control, time.time() - start,
                   describe_device(device), command_line(argv))
    Path(f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
