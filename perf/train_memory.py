"""What one training step keeps for backward: `python -m perf train-memory` (default: prod-125m geometry, one 16k-token
sequence, the NSA model and the same model with dense attention, perf/train_model.py).

Each model runs the trainer's forward (bf16 autocast on CUDA, labels given: the loss) twice:

1. as a step runs it: the memory allocated after the forward minus before it (what the step keeps for backward) and
   the peak of forward + backward above the same base (torch.cuda.memory_allocated / max_memory_allocated);
2. under saved-tensor hooks that record every tensor autograd saves: its storage (counted once, however many views
   of it are saved; parameters left out), the module whose forward was running (module hooks) and the autograd node
   that made it ("made by": its grad_fn, or "input" for a tensor made without one). Saved-tensor hooks change one
   thing: Eq. 5's output, which the output projection's backward recomputes when no other hooks are active
   (optimized.kernels.gated_sum.recomputed_in_backward), is kept instead, so pass 2 lists it while pass 1 does
   not keep it. With --activation-checkpointing a recomputed region saves nothing at the top level but its input
   (torch.utils.checkpoint's own hooks take the rest); what the kernel path keeps outside autograd for the
   recomputation, the selection and the selected branch's output (optimized.recompute.ForwardTape), is listed as
   kept by "ForwardTape", under the layer attention whose forward kept it.

The report lists, per model, the totals of both passes and, for the first layer's attention, every saved storage;
the other layers save the same. Memory numbers exist on CUDA only; on CPU (the test) the attribution runs alone.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from optimized.recompute import FORWARD_TAPE
from sentinels.model import NSALayerAttention, count_parameters

from .env import describe
from .train_model import Execution, batch_plan, geometry, trainer_for

MIB = 2 ** 20
FIRST_LAYER = "blocks.0."


def _made_by(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__ if t.grad_fn is not None else "input"


TAPE = "ForwardTape"  # "made by" of what a recomputation tape keeps


def saved_storages(model: torch.nn.Module, forward) -> list[dict[str, Any]]:
    """Every storage autograd saved during forward() (parameters left out), in saving order: module path, made by,
    shape and dtype of the first saved view, bytes of the whole storage; then what the recomputation tapes active
    in layer attentions hold after the forward (made by TAPE)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running = ["(model)"]
    tapes: dict[Any, str] = {}  # each tape -> the layer attention it belongs to

    def enter(name: str, module: torch.nn.Module) -> None:
        running.append(name)
        tape = FORWARD_TAPE.get()
        if tape is not None and isinstance(module, NSALayerAttention):
            tapes.setdefault(tape, name)

    def leave() -> None:  # a forward hook's return value would replace the module's output
        running.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: enter(name, m)))
            handles.append(module.register_forward_hook(lambda m, a, o: leave()))
    seen: dict[tuple[str, int], dict[str, Any]] = {}

    def record(t: torch.Tensor, module: str, made_by: str) -> None:
        storage = t.untyped_storage()
        key = (t.device.type, storage.data_ptr())
        if storage.data_ptr() not in params and key not in seen:
            seen[key] = {"module": module, "made_by": made_by, "shape": list(t.shape),
                         "dtype": str(t.dtype).replace("torch.", ""), "bytes": storage.nbytes()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t, running[-1], _made_by(t))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        for tape, module in tapes.items():
            for t in tape.kept_tensors():
                record(t, module, TAPE)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return list(seen.values())


def measure(geom_name: str, model_name: str, seq_len: int, device: torch.device,
            activation_checkpointing: bool | str = False) -> dict[str, Any]:
    """Both passes for one model: one sequence of seq_len tokens, with train.activation_checkpointing as given."""
    plan = batch_plan(seq_len, seq_len, seq_len)
    cuda = device.type == "cuda"
    execution = Execution(activation_checkpointing=activation_checkpointing)
    with trainer_for(geometry(geom_name), model_name, plan, steps=1, device=device, execution=execution) as trainer:
        model = trainer.model
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, model.embed.num_embeddings, (1, seq_len), generator=g).to(device)

        def forward() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                return model(ids, labels=ids)

        kept = peak = None
        if cuda:
            forward().backward()  # first call: kernels compiled, tables built, outside the measured pass
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            loss = forward()
            kept = torch.cuda.memory_allocated(device) - base
            loss.backward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            del loss
            model.zero_grad(set_to_none=True)
        storages = saved_storages(model, forward)
        parameters = count_parameters(model)
    attention = FIRST_LAYER + "attn"
    layer = [s for s in storages if s["module"] == attention or s["module"].startswith(attention + ".")]
    return {"model": model_name, "activation_checkpointing": activation_checkpointing, "parameters": parameters,
            "kept_after_forward_bytes": kept,
            "peak_forward_backward_bytes": peak, "saved_bytes": sum(s["bytes"] for s in storages),
            "first_layer_attention_saved_bytes": sum(s["bytes"] for s in layer), "first_layer_attention": layer,
            "saved_by_module": _by_module(storages)}


def _by_module(storages: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes saved per module of the first layer and the model's own (the other layers folded into one entry)."""
    out: dict[str, int] = defaultdict(int)
    for s in storages:
        name = s["module"]
        if name.startswith("blocks.") and not name.startswith(FIRST_LAYER):
            name = "(the other layers)"
        out[name] += s["bytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def model_label(m: dict[str, Any]) -> str:
    """The model's name, and what its backward recomputes when it does (in perf train's words: Execution.parts)."""
    parts = Execution(activation_checkpointing=m.get("activation_checkpointing", False)).parts()
    return m["model"] + (f" ({', '.join(parts)})" if parts else "")


def markdown(doc: dict[str, Any]) -> str:
    env = doc["env"]
    out = ["# What a training step keeps for backward: NSA against dense attention", "",
           f"{env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}. "
           f"`python -m perf train-memory` (perf/train_memory.py says how it measures).", ""]
    for case in doc["cases"]:
        models = {m["model"]: m for m in case["models"]}
        out += [f"## {case['geometry']}, one sequence of {case['seq_len']} tokens", "",
                "| model | parameters | kept after forward MiB | peak forward + backward MiB | saved (hooks) MiB | "
                "first layer's attention saved MiB |", "|---|---|---|---|---|---|"]
        for m in case["models"]:
            out.append(f"| {model_label(m)} | {m['parameters']:,} | {_mib(m['kept_after_forward_bytes'])} | "
                       f"{_mib(m['peak_forward_backward_bytes'])} | {_mib(m['saved_bytes'])} | "
                       f"{_mib(m['first_layer_attention_saved_bytes'])} |")
        if "nsa" in models and "dense" in models and models["nsa"]["kept_after_forward_bytes"] is not None:
            diff = models["nsa"]["kept_after_forward_bytes"] - models["dense"]["kept_after_forward_bytes"]
            out += ["", f"{model_label(models['nsa'])} keeps {_mib(abs(diff))} MiB {'more' if diff >= 0 else 'less'} "
                        f"than {model_label(models['dense'])} after the forward."]
        for m in case["models"]:
            out += ["", f"{model_label(m)}, the first layer's attention, each saved storage:", "",
                    "| module | made by | shape (first saved view) | dtype | MiB |", "|---|---|---|---|---|"]
            out += [f"| {s['module']} | {s['made_by']} | {tuple(s['shape'])} | {s['dtype']} | {_mib(s['bytes'])} |"
                    for s in m["first_layer_attention"]]
        out.append("")
    return "\n".join(out)


def run_train_memory(args, device: torch.device) -> Path:
    """`python -m perf train-memory`: measure each geometry's models, write train_memory.json and .md to --out."""
    doc = {"env": describe(device), "cases": []}
    for geom_name in args.geometries:
        case = {"geometry": geom_name, "seq_len": args.seq_len, "models": []}
        for model_name in args.models:
            case["models"].append(measure(geom_name, model_name, args.seq_len, device,
                                          args.activation_checkpointing.get(model_name, False)))
            m = case["models"][-1]
            print(f"    {geom_name} {model_label(m)} T={args.seq_len}: kept {_mib(m['kept_after_forward_bytes'])} "
                  f"MiB, peak {_mib(m['peak_forward_backward_bytes'])} MiB, first layer's attention saved "
                  f"{_mib(m['first_layer_attention_saved_bytes'])} MiB", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        doc["cases"].append(case)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_memory.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "train_memory.md").write_text(markdown(doc))
    print(f"perf train-memory: wrote {out}/train_memory.json and train_memory.md")
    return out

