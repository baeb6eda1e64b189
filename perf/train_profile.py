"""Where one training step's time goes: `python -m perf train-profile` (default: the NSA model, prod-125m geometry,
16k tokens per sequence, the batch plan of `perf train`; --models nsa,dense and --geometries prod-125m,paper profile
each pair into the same files).

The trainer (perf/train_model.py) runs `warmup` untimed steps, `timed` steps timed as in `perf train` (the step's
reference time, no profiler), then `profiled` steps under torch.profiler. During the profiled steps every region of
the model's forward is a named torch.profiler range (module hooks and wrappers, removed afterwards): embedding,
norms, each block's residual adds, its attention (the output projection, the gate MLP, project() (the one matmul
over the concatenated q, k and v weights, RoPE), the functional NSA call (or SDPA), the per-layer statistics, the
casts and reshapes around them), the MLP, the LM head, the loss, and the optimizer (gradient clipping and AdamW's
own step range). A GPU kernel counts toward the region of the op that launched it; a backward kernel counts toward
the region of the forward op whose autograd node ran it (the profiler's sequence numbers link each backward node to
its forward op). Categories:

- attention kernels: optimized's Triton kernels (NSA) or SDPA's kernels (dense), in any region, also those the
  profiler links to no op (by name; forward when they ran inside a region's range);
- the rest of attention: projections, gate MLP, RoPE, the NSA call's other kernels (phi, scoring glue, casts),
  statistics, casts around the call;
- MLP; embedding, norms, residual adds, LM head and loss; optimizer; other (data copies, gradient accumulation,
  kernels no op claimed).

Reported per step (the profiled steps' sum divided by their number): device time per category, split into forward,
backward and outside both (optimizer, data), next to the step's time without the profiler; the difference is time
the GPU waited for the host. On CPU the same attribution runs over the ops' own CPU time (there are no kernels),
which is how the tests check it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import pkgutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

from .env import describe
from .train_bench import StepClock, describe_attention
from .train_model import DenseAttention, attention_path, batch_plan, geometry, trainer_for

REGION = "region:"
EVALUATE = "autograd::engine::evaluate_function"
OPTIMIZER_RANGE = "Optimizer."  # torch.optim's own ranges: Optimizer.step#AdamW.step, Optimizer.zero_grad#...
SDPA_KERNEL_HINTS = ("flash", "fmha", "scaled_dot_product", "efficient_attention", "cudnn_attn")
PROFILE_JSON, PROFILE_MD = "train_profile.json", "train_profile.md"

ATTENTION_KERNELS = "attention kernels"
CATEGORIES = {  # region -> category (the table's row)
    "attention/projections": "attention rest: output projection",
    "attention/gates": "attention rest: gate MLP",
    "attention/project": "attention rest: project() (one q, k, v matmul, RoPE, splits)",
    "attention/nsa": "attention rest: inside the NSA call (phi, scoring glue, casts)",
    "attention/sdpa": "attention rest: around the SDPA call (transposes)",
    "attention/statistics": "attention rest: per-layer statistics",
    "attention": "attention rest: casts and reshapes around the call",
    "mlp": "MLP (SwiGLU)",
    "norms": "embedding, norms, residual adds, LM head, loss",
    "embedding": "embedding, norms, residual adds, LM head, loss",
    "block": "embedding, norms, residual adds, LM head, loss",
    "loss": "embedding, norms, residual adds, LM head, loss",
    "optimizer": "optimizer (gradient clipping, AdamW)",
}
OTHER = "other (data copies, gradient accumulation, unclaimed)"
ORDER = [ATTENTION_KERNELS, *dict.fromkeys(CATEGORIES.values()), OTHER]
DIRECTIONS = ("forward", "backward", "outside")


@functools.cache
def optimized_kernel_names() -> frozenset[str]:
    """Names of every Triton function the optimized package defines (kernels and their jit helpers)."""
    from triton.runtime.jit import JITFunction, KernelInterface

    import optimized

    names = set()
    for info in pkgutil.walk_packages(optimized.__path__, "optimized."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that cannot import here launches no kernel either
            continue
        for value in vars(module).values():
            if isinstance(value, KernelInterface):
                fn = value
                while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
                    fn = fn.fn
                names.add(getattr(fn, "__name__", None) or fn.fn.__name__)
    return frozenset(names)


def is_attention_kernel(name: str) -> bool:
    """optimized's Triton kernels and SDPA's kernels (flash / memory-efficient / cuDNN, or the CPU op)."""
    return name in optimized_kernel_names() or any(hint in name.lower() for hint in SDPA_KERNEL_HINTS)


# Regions ----------------------------------------------------------------------------------------------------------

class _Ranges:
    """Named torch.profiler ranges opened by forward pre-hooks and closed by forward hooks (one stack: the forward
    runs on one thread)."""

    def __init__(self):
        self.stack: list[record_function] = []
        self.handles: list[Any] = []

    def enter(self, name: str) -> None:
        scope = record_function(REGION + name)
        scope.__enter__()
        self.stack.append(scope)

    def exit(self) -> None:
        self.stack.pop().__exit__(None, None, None)

    def hook(self, module: torch.nn.Module, name: str) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda m, args: self.enter(name)))
        self.handles.append(module.register_forward_hook(lambda m, args, out: self.exit()))


def _ranged(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(REGION + name):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def regions(trainer) -> Iterator[None]:
    """Install the named ranges on the trainer's model, loss and optimizer; remove them on exit."""
    import sentinels.model

    model, ranges = trainer.model, _Ranges()
    patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) restored on exit
    wrapped: list[tuple[Any, str]] = []  # instance attributes shadowing a method, deleted on exit

    def patch(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        patched.append((owner, attr, original))
        setattr(owner, attr, _ranged(name, original))

    def wrap_method(obj, attr: str, name: str) -> None:
        setattr(obj, attr, _ranged(name, getattr(obj, attr)))
        wrapped.append((obj, attr))

    try:
        ranges.hook(model.embed, "embedding")
        ranges.hook(model.final_norm, "norms")
        for block in model.blocks:
            ranges.hook(block, "block")  # what the block itself runs: the residual adds
            ranges.hook(block.attn_norm, "norms")
            ranges.hook(block.mlp_norm, "norms")
            ranges.hook(block.mlp, "mlp")
            attn = block.attn
            ranges.hook(attn, "attention")
            if isinstance(attn, DenseAttention):
                ranges.hook(attn.o_proj, "attention/projections")  # q, k and v: one matmul inside project()
                wrap_method(attn, "project", "attention/project")
                wrap_method(attn, "attend", "attention/sdpa")
            else:
                inner = attn.inner
                for name, module in inner.named_children():
                    if name.endswith("_proj"):
                        ranges.hook(module, "attention/projections")
                if hasattr(inner, "gate"):
                    ranges.hook(inner.gate, "attention/gates")
                if hasattr(inner, "gates"):  # optimized.NSAAttention: the gate MLP, on its kernels or not
                    wrap_method(inner, "gates", "attention/gates")
                wrap_method(inner, "project", "attention/project")
                wrap_method(inner, "functional_forward", "attention/nsa")
        patch(sentinels.model, "_layer_stats", "attention/statistics")
        patch(sentinels.model, "lm_head_loss", "loss")  # the LM head and the loss, chunked (the trainer's path)
        patch(torch.nn.utils, "clip_grad_norm_", "optimizer")
        yield
    finally:
        for handle in ranges.handles:
            handle.remove()
        for obj, attr in wrapped:
            delattr(obj, attr)
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


# Attribution ------------------------------------------------------------------------------------------------------

def _claim_attention_kernels_no_op_launched(events, units, times, names) -> None:
    """Attention kernels on the GPU timeline that no CPU event lists among its launches (the profiler leaves some
    Triton launches unlinked, e.g. the selection's scoring and top-n kernels): counted as attention kernels by name,
    in the forward when every launch of that name starts inside a region's range on the GPU timeline (the ranges'
    user annotations), else outside."""
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_async]
    launches: dict[str, list[Any]] = defaultdict(list)
    for e in device:
        if not getattr(e, "is_user_annotation", False):
            launches[e.name].append(e)
    claimed: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, duration, _ in units:
        claimed[name][0] += 1
        claimed[name][1] += duration
    regions = None
    for name, runs in launches.items():
        count, us = len(runs) - claimed[name][0], sum(e.time_range.elapsed_us() for e in runs) - claimed[name][1]
        if count <= 0 or us <= 0 or not is_attention_kernel(name):
            continue
        if regions is None:
            regions = [(e.time_range.start, e.time_range.end) for e in device
                       if getattr(e, "is_user_annotation", False) and e.name.startswith(REGION)]
        inside = all(any(a <= e.time_range.start <= b for a, b in regions) for e in runs)
        times[(ATTENTION_KERNELS, "forward" if inside else "outside")] += us
        names[(ATTENTION_KERNELS, name)][0] += us
        names[(ATTENTION_KERNELS, name)][1] += count


def _chain(event) -> Iterator[Any]:
    while event is not None:
        yield event
        event = event.cpu_parent


def _region_of(event) -> str | None:
    for e in _chain(event):
        if e.name.startswith(REGION):
            return e.name[len(REGION):]
        if e.name.startswith(OPTIMIZER_RANGE):
            return "optimizer"
    return None


def _is_backward(event) -> bool:
    return any(e.name.startswith(EVALUATE) for e in _chain(event))


def attribute(events, on_cuda: bool) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], list[float]],
                                              float]:
    """(category, direction) -> microseconds, (category, kernel or op name) -> [microseconds, count], and the total
    device time (CUDA kernels and copies; on CPU the ops' own CPU time)."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    # Sequence numbers count per thread: only the thread that ran the forward (the one with region ranges) makes the
    # autograd nodes the backward runs.
    forward_threads = {e.thread for e in cpu if e.name.startswith(REGION)}
    forward_region: dict[int, tuple[float, str | None]] = {}  # sequence number -> (start, region) of its forward op
    for e in cpu:
        if (e.sequence_nr < 0 or e.thread not in forward_threads or e.name.startswith(REGION)
                or _is_backward(e)):
            continue
        seen = forward_region.get(e.sequence_nr)
        if seen is None or e.time_range.start >= seen[0]:  # the node is made by the last op recording its number
            forward_region[e.sequence_nr] = (e.time_range.start, _region_of(e))

    def locate(event) -> tuple[str | None, str]:
        for e in _chain(event):
            if e.name.startswith(REGION):
                return e.name[len(REGION):], "forward"
            if e.name.startswith(OPTIMIZER_RANGE):
                return "optimizer", "outside"
            if e.name.startswith(EVALUATE):
                found = forward_region.get(e.sequence_nr)
                return (found[1] if found else None), "backward"
        return None, "outside"

    units: list[tuple[str, float, Any]] = []
    if on_cuda:
        # A record_function range also appears on the GPU timeline as a user annotation spanning its kernels
        # (correlated to the range's CPU event, so listed among its "kernels" under the range's own name): it is
        # not device work, and counting it counts the kernels under it twice.
        for e in cpu:
            units += [(k.name, k.duration, e) for k in e.kernels if k.name != e.name]
        total = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                    and not getattr(e, "is_user_annotation", False))
    else:
        units = [(e.name, e.self_cpu_time_total, e) for e in cpu if not e.name.startswith(REGION)]
        total = sum(u[1] for u in units)
    times: dict[tuple[str, str], float] = defaultdict(float)
    names: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, duration, event in units:
        region, direction = locate(event)
        if region == "optimizer":
            direction = "outside"
        category = ATTENTION_KERNELS if is_attention_kernel(name) else CATEGORIES.get(region or "", OTHER)
        times[(category, direction)] += duration
        names[(category, name)][0] += duration
        names[(category, name)][1] += 1
    if on_cuda:
        _claim_attention_kernels_no_op_launched(events, units, times, names)
    unclaimed = total - sum(times.values())
    if unclaimed > 0:
        times[(OTHER, "outside")] += unclaimed
        names[(OTHER, "(kernels no op launched)")][0] += unclaimed
    return dict(times), dict(names), total


# One profile ------------------------------------------------------------------------------------------------------

def profile_case(geom_name: str, model: str, seq_len: int, tokens_per_step: int, micro_tokens: int, *, warmup: int,
                 timed: int, profiled: int, device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    if timed < 1 or profiled < 1 or warmup < 0:
        raise ValueError(f"--timed and --profiled must be >= 1 and --warmup >= 0, got {timed}, {profiled}, {warmup}")
    plan = batch_plan(seq_len, tokens_per_step, micro_tokens)
    on_cuda = device.type == "cuda"
    clock = StepClock(device, warmup, timed + profiled, deadline=float("inf"), profile_kernels=False)
    state: dict[str, Any] = {}

    def hook(trainer, step: int) -> None:
        clock(trainer, step)
        if step == warmup + timed:
            state["regions"] = regions(trainer)
            state["regions"].__enter__()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            state["profiler"] = profile(activities=activities)
            state["profiler"].__enter__()

    started = time.perf_counter()
    with trainer_for(geometry(geom_name), model, plan, steps=warmup + timed + profiled, device=device,
                     step_hook=hook) as trainer:
        try:
            trainer.train()
            clock.finish()
        finally:
            if "profiler" in state:
                state["profiler"].__exit__(None, None, None)
            if "regions" in state:
                state["regions"].__exit__(None, None, None)
        path = describe_attention(trainer.model, None)
        switches = attention_path(trainer.model)
    steps_ms = clock.step_ms()
    step_ms = statistics.median(steps_ms[warmup:warmup + timed])
    times, names, total = attribute(state["profiler"].events(), on_cuda)
    per_step = 1e-3 / profiled  # microseconds summed over the profiled steps -> milliseconds per step
    categories = []
    for category in ORDER:
        split = {d: times.get((category, d), 0.0) * per_step for d in DIRECTIONS}
        if any(split.values()):
            categories.append({"category": category, **{f"{d}_ms": v for d, v in split.items()},
                               "total_ms": sum(split.values()), "share": sum(split.values()) / (total * per_step)})
    top: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (category, name), (us, count) in sorted(names.items(), key=lambda kv: -kv[1][0]):
        if len(top[category]) < 8:
            top[category].append({"name": name[:120], "ms_per_step": us * per_step,
                                  "launches_per_step": count / profiled})
    return {"geometry": geom_name, "model": model, "seq_len": seq_len, "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum, "tokens_per_step": plan.tokens, "warmup_steps": warmup,
            "timed_steps": timed, "profiled_steps": profiled, "step_ms_median": step_ms,
            "profiled_step_ms": steps_ms[warmup + timed:], "device_ms_per_step": total * per_step,
            "time_unit": "CUDA kernel time" if on_cuda else "CPU time of the ops (no kernels on CPU)",
            "attention": path, "attention_switches": switches, "categories": categories, "top": dict(top),
            "wall_s": round(time.perf_counter() - started, 1)}


def markdown(result: dict[str, Any]) -> str:
    env = result.get("env", {})
    out = ["# One training step, by region", "",
           f"{env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
           f"CUDA {env.get('cuda', '?')}. `python -m perf train-profile` (perf/train_profile.py says how regions and "
           f"backward kernels are attributed).", ""]
    for p in result["profiles"]:
        unit = p["time_unit"]
        out += [f"## {p['model']}, {p['geometry']}, seq_len {p['seq_len']} ({p['micro_batch']} x {p['grad_accum']} "
                f"micro-steps, {p['tokens_per_step']} tokens per step)", "",
                f"Step without the profiler: **{p['step_ms_median']:.1f} ms** (median of {p['timed_steps']}); "
                f"{unit} per profiled step: {p['device_ms_per_step']:.1f} ms"
                + (f"; the rest, {p['step_ms_median'] - p['device_ms_per_step']:.1f} ms, the device waited for the "
                   f"host" if p["step_ms_median"] > p["device_ms_per_step"] else "") + ".", "",
                *([f"**The {unit} per profiled step exceeds the step itself by more than 5%: the attribution "
                   "counts some device work twice (or kernels of two streams overlapped), so read the per-region "
                   "times with care.**", ""]
                  if p["device_ms_per_step"] > 1.05 * p["step_ms_median"] and "CUDA" in unit else []),
                f"Attention: {p['attention']}.", "",
                "| category | forward ms | backward ms | outside ms | total ms | share |", "|---|---|---|---|---|---|"]
        rest = [c for c in p["categories"] if c["category"].startswith("attention rest")]
        for c in p["categories"]:
            out.append(f"| {c['category']} | {c['forward_ms']:.2f} | {c['backward_ms']:.2f} | {c['outside_ms']:.2f} | "
                       f"{c['total_ms']:.2f} | {100 * c['share']:.1f}% |")
        if rest:
            total = sum(c["total_ms"] for c in rest)
            share = sum(c["share"] for c in rest)
            out.append(f"| **attention rest, all** | {sum(c['forward_ms'] for c in rest):.2f} | "
                       f"{sum(c['backward_ms'] for c in rest):.2f} | {sum(c['outside_ms'] for c in rest):.2f} | "
                       f"**{total:.2f}** | {100 * share:.1f}% |")
        out += ["", "<details><summary>largest kernels (ops on CPU) per category</summary>", "",
                "| category | kernel | ms per step | launches per step |", "|---|---|---|---|"]
        for category, kernels in p["top"].items():
            for k in kernels:
                out.append(f"| {category} | `{k['name'][:90]}` | {k['ms_per_step']:.3f} | "
                           f"{k['launches_per_step']:.0f} |")
        out += ["", "</details>", ""]
    return "\n".join(out)


def run_profiles(args, device: torch.device) -> dict[str, Any]:
    result = {"env": describe(device), "profiles": []}
    out_dir = Path(args.out)
    for geom in args.geometries:
        for model in args.models:
            p = profile_case(geom, model, args.seq_len, args.tokens_per_step, args.micro_tokens, warmup=args.warmup,
                             timed=args.timed, profiled=args.profiled, device=device)
            result["profiles"].append(p)
            print(f"perf train-profile: {model} {geom} T={args.seq_len}: step {p['step_ms_median']:.1f} ms, "
                  f"device {p['device_ms_per_step']:.1f} ms per step", flush=True)
            for c in p["categories"]:
                print(f"  {c['total_ms']:9.2f} ms  {100 * c['share']:5.1f}%  {c['category']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PROFILE_JSON).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / PROFILE_MD).write_text(markdown(result))
    print(f"perf train-profile: wrote {out_dir / PROFILE_JSON} and {out_dir / PROFILE_MD}")
    return result
