"""train.md and train.png from train.csv (and the environment in train.json): `python -m perf train-report`.

Everything shown is read from the CSV rows; the only numbers computed here are the NSA / dense ratios.
"""

from __future__ import annotations

from pathlib import Path

from .plots import annotate_points, pyplot, save, seq_len_axis, unity_line
from .train_bench import MEMORY_TARGET_FROM, OK, TARGETS, TRAIN_CSV, TRAIN_MD, TRAIN_PNG, TrainRow, read_meta, \
    read_rows

MODEL_TITLE = {"nsa": "NSA", "dense": "dense (causal SDPA, GQA)"}
COLORS = {"nsa": "tab:blue", "dense": "tab:orange"}


def _t(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def _index(rows: list[TrainRow]) -> dict[tuple[str, str, int], TrainRow]:
    return {r.key: r for r in rows}


def ratios(rows: list[TrainRow], geom: str) -> list[tuple[int, float]]:
    """[(seq_len, NSA tokens/s / dense tokens/s)] where both ran ok."""
    idx = _index(rows)
    out = []
    for T in sorted({r.seq_len for r in rows if r.geometry == geom}):
        nsa, dense = idx.get((geom, "nsa", T)), idx.get((geom, "dense", T))
        if nsa and dense and nsa.status == OK and dense.status == OK:
            out.append((T, nsa.tokens_per_s / dense.tokens_per_s))
    return out


def _gib(value: int | None) -> str:
    return "-" if not value else f"{value / 2**30:.1f}"


def _cell(row: TrainRow | None, what: str) -> str:
    if row is None:
        return "not run"
    if row.status != OK:
        return row.status.upper()
    if what == "tps":
        return f"{row.tokens_per_s:,.0f}"
    if what == "mem":
        return _gib(row.peak_mem_bytes)
    return f"{row.median_step_ms:.1f} / {row.mean_step_ms:.1f}"


def execution_label(nsa: TrainRow | None, dense: TrainRow | None) -> str:
    """How a table row's steps ran: what both models did, then what only one of them did ("NSA: attention
    recomputed" where the dense model kept its activations)."""
    parts = {m: r.execution.parts() for m, r in (("nsa", nsa), ("dense", dense)) if r is not None}
    shared = [p for p in dict.fromkeys(sum(parts.values(), [])) if all(p in ps for ps in parts.values())]
    only = [f"{MODEL_TITLE[m].split(' ')[0]}: {p}" for m, ps in parts.items() for p in ps if p not in shared]
    return ", ".join(shared + only)


def _differing(pairs) -> str:
    """' (NSA: ...)' where the NSA and dense rows of pairs ran differently, naming how."""
    labels = dict.fromkeys(execution_label(n, d) for _, n, d in pairs if n and d and n.execution != d.execution)
    return f" ({'; '.join(labels)})" if labels else ""


def target_lines(rows: list[TrainRow], geom: str) -> list[str]:
    idx = _index(rows)
    lines = []
    for T, target in TARGETS.get(geom, ()):
        nsa, dense = idx.get((geom, "nsa", T)), idx.get((geom, "dense", T))
        head = f"- NSA tokens/s >= {target}x dense at {_t(T)}: "
        missing = [f"{m} {r.status if r else 'not run'}" for m, r in (("nsa", nsa), ("dense", dense))
                   if r is None or r.status != OK]
        if missing:
            lines.append(head + "NOT MEASURED (" + ", ".join(missing) + ")")
            continue
        ratio = nsa.tokens_per_s / dense.tokens_per_s
        lines.append(head + f"measured {ratio:.2f}x ({nsa.tokens_per_s:,.0f} / {dense.tokens_per_s:,.0f} tokens/s): "
                     + ("MET" if ratio >= target else "NOT MET") + _differing([(T, nsa, dense)]))
    pairs = [(T, idx.get((geom, "nsa", T)), idx.get((geom, "dense", T)))
             for T in sorted({r.seq_len for r in rows if r.geometry == geom}) if T >= MEMORY_TARGET_FROM]
    measured = [(T, n, d) for T, n, d in pairs if n and d and n.status == OK and d.status == OK
                and n.peak_mem_bytes and d.peak_mem_bytes]
    if measured:
        over = [f"{_t(T)} ({_gib(n.peak_mem_bytes)} > {_gib(d.peak_mem_bytes)} GiB)" for T, n, d in measured
                if n.peak_mem_bytes > d.peak_mem_bytes]
        unmeasured = [_t(T) for T, n, d in pairs if (T, n, d) not in measured]
        lines.append(f"- NSA peak memory <= dense at every seq_len >= {_t(MEMORY_TARGET_FROM)}: "
                     + (("NOT MET at " + ", ".join(over)) if over else "MET")
                     + (f" (not measured at {', '.join(unmeasured)})" if unmeasured else "") + _differing(measured))
    return lines


def markdown(rows: list[TrainRow], meta: dict) -> str:
    env = meta.get("env", {})
    smi, smi_end = env.get("nvidia_smi") or {}, env.get("nvidia_smi_end") or {}
    clocks = (f" (SM clock {smi.get('clocks.sm', '?')} MHz at start, {smi_end.get('clocks.sm', '?')} at end, max "
              f"{smi.get('clocks.max.sm', '?')}; memory clock {smi.get('clocks.mem', '?')} MHz; "
              f"{smi.get('power.limit', '?')} W limit; driver {smi.get('driver_version', '?')})" if smi else "")
    out = ["# Training throughput: NSA against the same model with dense attention", "",
           f"{env.get('device', '?')}{clocks}; host {env.get('host_cpu', 'not recorded')}; torch "
           f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}.", "",
           f"Full trainer steps (`sentinels.trainer.Trainer`: forward, backward, gradient clipping, AdamW, the "
           f"per-step statistics) of the NSA model and of the same model with each layer's attention replaced by "
           f"causal SDPA with GQA over the same q / k / v / output projections and RoPE (`perf/train_model.py`), "
           f"one process. {meta.get('tokens_per_step', '?')} tokens per optimizer step at every sequence length "
           f"(micro-batch x gradient accumulation below, at most {meta.get('micro_batch_tokens', '?')} tokens per "
           f"micro-step); {meta.get('warmup_steps', '?')} warm-up steps, then the median (and mean) of "
           f"{meta.get('timed_steps', '?')} timed steps ({meta.get('timing', '')}); tokens/s = tokens per step / "
           f"median step; peak memory = torch.cuda.max_memory_allocated over the timed steps (rows with CUDA graphs: "
           f"torch.cuda.max_memory_reserved, which counts the graphs' private memory pools). Activation "
           f"checkpointing (train.activation_checkpointing) and CUDA graphs (train.cuda_graphs): off unless a row "
           f"says so (\"NSA: ...\" where only the NSA model ran so).", ""]
    kept, earlier = meta.get("kept_rows") or [], meta.get("earlier") or []
    if kept:
        where = "; ".join(f"{e['env'].get('device', '?')}, torch {e['env'].get('torch', '?')}, triton "
                          f"{e['env'].get('triton', '?')}" for e in earlier) or "not recorded"
        out += [f"Rows this sweep did not measure again come from an earlier sweep into this file ({where}): "
                f"{', '.join(kept)}.", ""]
    idx = _index(rows)
    for geom in dict.fromkeys(r.geometry for r in rows):
        out += [f"## {geom}", "", (meta.get("geometries") or {}).get(geom, ""), ""]
        header = ["seq_len", "micro-batch x accumulation", "NSA tokens/s", "dense tokens/s", "NSA / dense",
                  "NSA peak GiB", "dense peak GiB", "NSA step ms (median / mean)", "dense step ms (median / mean)"]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        ratio = dict(ratios(rows, geom))
        for T in sorted({r.seq_len for r in rows if r.geometry == geom}):
            nsa, dense = idx.get((geom, "nsa", T)), idx.get((geom, "dense", T))
            any_row = nsa or dense
            label = execution_label(nsa, dense)
            cells = [_t(T) + (f" ({label})" if label else ""), f"{any_row.micro_batch} x {any_row.grad_accum}",
                     _cell(nsa, "tps"), _cell(dense, "tps"), f"{ratio[T]:.2f}x" if T in ratio else "-",
                     _cell(nsa, "mem"), _cell(dense, "mem"), _cell(nsa, "ms"), _cell(dense, "ms")]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", "Targets:", ""] + (target_lines(rows, geom) or ["- none for this geometry"]) + [""]
        paths = {}
        for r in rows:
            if r.geometry == geom and r.attention:
                paths.setdefault(r.model, r.attention)
        for model, text in paths.items():
            out.append(f"- {MODEL_TITLE.get(model, model)} attention: {text}")
        notes = [f"- {r.model} at {_t(r.seq_len)}: {r.status.upper()}: {r.note}" for r in rows
                 if r.geometry == geom and r.status != OK]
        out += ([""] if paths else []) + notes + ([""] if notes else [])
    out += [f"![tokens/s, NSA / dense and peak memory against seq_len]({TRAIN_PNG})", ""]
    return "\n".join(out)


def plot(rows: list[TrainRow], path: Path, title: str) -> Path:
    plt = pyplot()
    geoms = list(dict.fromkeys(r.geometry for r in rows))
    fig, grid = plt.subplots(3, len(geoms), figsize=(6.2 * len(geoms), 11), squeeze=False)
    for col, geom in enumerate(geoms):
        ax_tps, ax_ratio, ax_mem = grid[0][col], grid[1][col], grid[2][col]
        seq_lens = sorted({r.seq_len for r in rows if r.geometry == geom})
        for offset, model in zip((8, -14), ("nsa", "dense")):
            ok = sorted((r.seq_len, r) for r in rows if r.geometry == geom and r.model == model and r.status == OK)
            if not ok:
                continue
            xs = [T for T, _ in ok]
            tps = [r.tokens_per_s for _, r in ok]
            ax_tps.plot(xs, tps, marker="o", color=COLORS[model], label=MODEL_TITLE[model])
            annotate_points(ax_tps, xs, tps, [f"{v / 1e3:,.1f}k" for v in tps], offset, COLORS[model])
            mem = [(T, r.peak_mem_bytes / 2**30) for T, r in ok if r.peak_mem_bytes]
            if mem:
                ax_mem.plot(*zip(*mem), marker="o", color=COLORS[model], label=MODEL_TITLE[model])
                annotate_points(ax_mem, [m[0] for m in mem], [m[1] for m in mem], [f"{m[1]:.1f}" for m in mem],
                                offset, COLORS[model])
        pts = ratios(rows, geom)
        if pts:
            ax_ratio.plot(*zip(*pts), marker="o", color=COLORS["nsa"], label="NSA / dense")
            annotate_points(ax_ratio, [p[0] for p in pts], [p[1] for p in pts], [f"{p[1]:.2f}x" for p in pts], 8,
                            COLORS["nsa"])
        unity_line(ax_ratio, "dense (1x)")
        for T, target in TARGETS.get(geom, ()):
            ax_ratio.plot([T], [target], marker="*", color="red", markersize=11, linestyle="none",
                          label="target" if T == TARGETS[geom][0][0] else None)
        if not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "no GPU memory statistics (CPU run)", ha="center", transform=ax_mem.transAxes)
        for ax in (ax_tps, ax_ratio, ax_mem):
            seq_len_axis(ax, seq_lens)
            ax.set_ylim(bottom=0)
            ax.margins(y=0.18)
        ax_tps.set_ylabel("training throughput (tokens/s)")
        ax_ratio.set_ylabel("NSA tokens/s / dense tokens/s (x)")
        ax_mem.set_ylabel("peak memory (GiB)")
        ax_tps.set_title(f"{geom}: tokens/s (median step)", fontsize=10)
        ax_ratio.set_title(f"{geom}: NSA / dense", fontsize=10)
        ax_mem.set_title(f"{geom}: peak allocated memory over the timed steps", fontsize=10)
    handles = {}
    for ax in grid.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=9,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return save(fig, path, plt)


def make_report(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    rows = read_rows(out_dir / TRAIN_CSV)
    meta = read_meta(out_dir)
    env = meta.get("env", {})
    (out_dir / TRAIN_MD).write_text(markdown(rows, meta))
    title = f"training steps, {env.get('device', '?')}, torch {env.get('torch', '?')}"
    return [out_dir / TRAIN_MD, plot(rows, out_dir / TRAIN_PNG, title)]
