"""The sentinel suite: short runs with named verdicts, and the sensitivity self-test with planted faults.

Sentinels (thresholds: sentinels/thresholds.py; docs/sentinels.md):
  label_shift    every pipeline batch satisfies labels[:, :-1] == inputs[:, 1:] (packed batches: the same shift
                 inside each document, the ignore label at its end); misaligned or boundary-crossing batches
                 are refused
  doc_isolation  packed documents (data.packing varlen) on the run model: changing one document's tokens moves no
                 logit of another document, and each document's logits equal those of the document run alone
  random_label   i.i.d. uniform tokens: the held-out loss stays within RANDOM_LABEL_MARGIN_NATS of ln(V)
  long_range     needle recall beyond the window: full NSA learns it, locals-only (g_cmp = g_slc = 0) cannot
  loss_floor     real text: no step loss below the floor (the trainer's LossFloorMonitor)
  gate_collapse  real text: no branch gate pinned near 0 or 1 (GateCollapseMonitor); gate stats every step
  watchdog       real text: no non-finite/zero gradient or stalled heartbeat (FAIL); throughput or data-fetch
                 slowdowns are WARN (they depend on the machine's load)
  loss_floor_varlen, gate_collapse_varlen, watchdog_varlen: the real-text run again with data.packing varlen
Self-test: the same sentinels with planted faults must trip (kv_next_token and cmp_block_early leaks,
misaligned labels, labels across document boundaries, a cross-document attention leak, saturated gates, a NaN
weight, a slowing data source).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from reference.packing import check_cu_seqlens, cu_seqlens_of

from . import thresholds
from .config import RunConfig
from .data.batch import Batch, LabelShiftError, check_next_token_alignment, check_packed_alignment
from .data.pipeline import BatchSource
from .data.sources import ShardSpec
from .model import build_model, lm_loss, packs_documents
from .profiles import Profile
from .trainer import Trainer, TrainResult

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
HELD_OUT_SEED_OFFSET = 1_000_003  # eval batches use another data seed than training


@dataclass
class SentinelResult:
    name: str
    verdict: str
    summary: str
    threshold: str
    metrics: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)  # label -> per-step training loss
    wall_s: float = 0.0
    planted: str | None = None  # self-test rows: the planted fault; they pass when the sentinel trips

    @property
    def tripped(self) -> bool:
        return self.verdict in (FAIL, WARN)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BudgetExhausted(RuntimeError):
    pass


class SentinelRunner:
    def __init__(self, profile: Profile, *, run_config: RunConfig, probe_config: RunConfig, work_dir: Path,
                 corpus: Path | None, budget_s: float | None = None, log: Callable[[str], None] = print):
        self.profile = profile
        self.run_config, self.probe_config = run_config, probe_config
        self.work_dir = work_dir
        self.corpus = corpus
        self.deadline = time.monotonic() + (budget_s if budget_s is not None else profile.budget_s)
        self.log = log
        self._run_no = 0

    # -- plumbing -------------------------------------------------------------------------------------
    def _config(self, base: RunConfig, overrides: dict[str, Any]) -> RunConfig:
        self._run_no += 1
        out_dir = self.work_dir / f"run{self._run_no:02d}"
        shutil.rmtree(out_dir, ignore_errors=True)
        fixed = {"train.device": self.profile.device, "train.precision": self.profile.precision,
                 "train.out_dir": str(out_dir), "train.save_every": 0}
        return base.replace(**{**overrides, **fixed})

    def _train(self, cfg: RunConfig, *, step_hook=None, batch_source=None) -> tuple[Trainer, TrainResult]:
        if time.monotonic() > self.deadline:
            raise BudgetExhausted("the profile's time budget is spent")
        run_deadline = min(self.deadline, time.monotonic() + self.profile.run_cap_s)

        def hook(trainer: Trainer, step: int) -> None:
            if time.monotonic() > run_deadline:
                trainer.request_stop(f"time cap ({self.profile.run_cap_s:.0f} s per run, profile budget "
                                     f"{self.profile.budget_s:.0f} s)")
            if step_hook is not None:
                step_hook(trainer, step)

        trainer = Trainer(cfg, step_hook=hook, batch_source=batch_source, console=False, save_checkpoints=False)
        result = trainer.train()
        trainer.close()
        return trainer, result

    @staticmethod
    def _losses(result: TrainResult) -> list[float]:
        return [r["loss"] for r in result.records]

    @staticmethod
    def _cut(result: TrainResult, cfg: RunConfig) -> str:
        """A note when the run stopped early for another reason than a monitor's own halt."""
        if result.steps_done >= cfg.train.steps or (result.halt_reason or "").startswith("loss_floor"):
            return ""
        return f" (cut at step {result.steps_done}: {result.halt_reason})"

    @torch.no_grad()
    def _evaluate(self, trainer: Trainer, cfg: RunConfig, n_batches: int) -> dict[str, float]:
        """Held-out loss (and accuracy at masked positions) on batches drawn with another data seed."""
        held_out = cfg.replace(**{"data.shuffle_seed": cfg.data.shuffle_seed + HELD_OUT_SEED_OFFSET})
        source = BatchSource(held_out, ShardSpec(0, 1), synthetic_on_fail=False)
        model = trainer.model
        model.eval()
        losses, correct, counted = [], 0.0, 0.0
        for _ in range(n_batches):
            batch = source.next_batch().to(trainer.device)
            with trainer._autocast():
                logits = model(batch.inputs, batch.cu_seqlens)
            losses.append(float(lm_loss(logits, batch.labels, batch.loss_mask)))
            hits = (logits.argmax(-1) == batch.labels).float()
            mask = torch.ones_like(hits) if batch.loss_mask is None else batch.loss_mask
            correct += float((hits * mask).sum())
            counted += float(mask.sum())
        return {"eval_loss": sum(losses) / len(losses), "eval_accuracy": correct / counted}

    # -- sentinels ---------------------------------------------------------------------------------
    def label_shift(self, make_batch: Callable[[torch.Tensor], Batch] = Batch.from_windows,
                    make_packed: Callable[[torch.Tensor, torch.Tensor], Batch] = Batch.packed,
                    planted: str | None = None) -> SentinelResult:
        """Pipeline batches (synthetic tasks and, if available, real text; contiguous windows and packed
        documents) pass the alignment check, and the check refuses labels equal to the inputs, shifted by two,
        or crossing a document boundary."""
        t0 = time.monotonic()
        uniform = {"data.source": "synthetic", "data.synthetic.task": "uniform"}
        sources = {"uniform": self.probe_config.replace(**uniform),
                   "needle_recall": self.probe_config.replace(**{"data.source": "synthetic",
                                                                  "data.synthetic.task": "needle_recall"})}
        packed_sources = {"uniform varlen": self.probe_config.replace(**uniform, **{"data.packing": "varlen"})}
        if self.corpus is not None:
            real_text = {"data.source": "jsonl", "data.paths": [str(self.corpus)]}
            sources["real_text"] = self.run_config.replace(**real_text)
            packed_sources["real_text varlen"] = self.run_config.replace(**real_text, **{"data.packing": "varlen"})
        checked, problems = 0, []
        for label, cfg in {**sources, **packed_sources}.items():
            src = BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=False)
            for _ in range(self.profile.label_shift_batches):
                batch = src.next_batch()
                try:
                    if label in packed_sources:  # the (tokens, boundaries) -> (inputs, labels) step under test
                        rebuilt = make_packed(batch.inputs[0], batch.cu_seqlens)
                        check_packed_alignment(rebuilt.inputs, rebuilt.labels, rebuilt.cu_seqlens)
                    else:  # the window -> (inputs, labels) step under test
                        rebuilt = make_batch(torch.cat([batch.inputs, batch.labels[:, -1:]], dim=1))
                        check_next_token_alignment(rebuilt.inputs, rebuilt.labels)
                except LabelShiftError as exc:
                    problems.append(f"{label}: {exc}")
                    break
                checked += 1
        refused = 0
        windows = torch.arange(2 * 9).view(2, 9)
        tokens, boundaries = torch.arange(10)[None], cu_seqlens_of([4, 6])
        misaligned = {"labels == inputs": lambda: Batch(inputs=windows[:, :-1], labels=windows[:, :-1]),
                      "labels shifted by 2": lambda: Batch(inputs=windows[:, :-2], labels=windows[:, 2:]),
                      "a label across a document boundary": lambda: Batch(
                          inputs=tokens, labels=tokens + 1, loss_mask=torch.ones(1, 10), cu_seqlens=boundaries)}
        for name, build in misaligned.items():
            try:
                build()
                problems.append(f"the check accepted a misaligned batch ({name})")
            except LabelShiftError:
                refused += 1
        verdict = PASS if not problems else FAIL
        summary = (f"{checked} pipeline batches aligned ({len(packed_sources)} packed sources); "
                   f"{refused}/{len(misaligned)} misaligned batches refused"
                   if not problems else f"{len(problems)} problem(s); first: {problems[0]}")
        return SentinelResult("label_shift", verdict, summary,
                              "labels[:, :-1] == inputs[:, 1:] for every batch; packed: the same inside each "
                              "document and the ignore label at its last token",
                              metrics={"batches_checked": checked, "misaligned_refused": refused},
                              wall_s=time.monotonic() - t0, planted=planted)

    def doc_isolation(self, leak: str = "none", planted: str | None = None) -> SentinelResult:
        """The run model (untrained, fp32, TF32 off) on one packed row of documents of edge lengths: changing one
        document's tokens must move no logit of another document, and each document's logits must equal those
        of the document run alone."""
        t0 = time.monotonic()
        cfg = self.run_config.replace(**{"data.packing": "varlen", "model.debug.leak": leak})
        if not packs_documents(cfg.model.attention):
            return SentinelResult("doc_isolation", SKIP, f"model.attention {cfg.model.attention!r}: its "
                                  "NSAAttention seams do not take cu_seqlens", "-", planted=planted)
        device = torch.device(self.profile.device)
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg).to(device).eval()
        lengths = isolation_lengths(cfg.model.nsa_config())
        cu = cu_seqlens_of(lengths, device)
        spans = [(a, b) for a, b in check_cu_seqlens(cu, sum(lengths), 1) if b > a]
        vocab = cfg.vocab_size()
        tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(0)).to(device)
        alone_diff, perturb_diff, own_change = 0.0, 0.0, float("inf")
        with torch.no_grad(), _no_tf32():
            packed = model(tokens, cu).float()
            scale = float(packed.abs().max().clamp(min=1e-30))
            for a, b in spans:
                alone = model(tokens[:, a:b]).float()
                alone_diff = max(alone_diff, float((alone - packed[:, a:b]).abs().max()) / scale)
                changed = tokens.clone()
                changed[:, a:b] = (changed[:, a:b] + 1) % vocab
                diff = (model(changed, cu).float() - packed).abs().amax(-1)[0] / scale
                outside = torch.cat([diff[:a], diff[b:]])
                perturb_diff = max(perturb_diff, float(outside.max()) if outside.numel() else 0.0)
                own_change = min(own_change, float(diff[a:b].max()))
        problems = []
        if perturb_diff > thresholds.DOC_ISOLATION_PERTURB_MAX:
            problems.append("changing one document moved another document's logits: attention crosses a boundary")
        if alone_diff > thresholds.DOC_ISOLATION_ALONE_MAX:
            problems.append("a packed document's logits differ from the document run alone")
        if own_change <= 0:
            problems.append("changing a document's tokens did not change its own logits: the check saw nothing")
        return SentinelResult(
            "doc_isolation", FAIL if problems else PASS,
            f"{len(spans)} documents {lengths} packed: other documents moved by {perturb_diff:.2e}, packed vs alone "
            f"{alone_diff:.2e} (relative to max |logit| {scale:.3g})" + ("" if not problems else " - "
                                                                           + "; ".join(problems)),
            f"other documents move <= {thresholds.DOC_ISOLATION_PERTURB_MAX:g}, packed vs alone <= "
            f"{thresholds.DOC_ISOLATION_ALONE_MAX:g} (relative to max |logit|)",
            metrics={"lengths": lengths, "perturb_max_rel": perturb_diff, "alone_max_rel": alone_diff,
                     "own_change_min_rel": own_change, "logit_scale": scale, "attention": cfg.model.attention},
            wall_s=time.monotonic() - t0, planted=planted)

    def random_label(self, leak: str = "none", planted: str | None = None) -> SentinelResult:
        t0 = time.monotonic()
        cfg = self._config(self.probe_config, {**self.profile.random_label, "data.source": "synthetic",
                                               "data.synthetic.task": "uniform", "model.debug.leak": leak})
        trainer, result = self._train(cfg)
        ev = self._evaluate(trainer, cfg, self.profile.eval_batches)
        ln_v = math.log(cfg.data.synthetic.vocab_size)
        gap = ev["eval_loss"] - ln_v
        margin = thresholds.RANDOM_LABEL_MARGIN_NATS
        verdict = PASS if abs(gap) <= margin else FAIL
        why = "" if verdict == PASS else (" - below ln V: the model predicts random labels, it sees them (leak)"
                                          if gap < 0 else " - above ln V: the model did not even learn the marginal")
        return SentinelResult(
            "random_label", verdict,
            f"held-out loss {ev['eval_loss']:.4f} vs ln V {ln_v:.4f} (gap {gap:+.4f}){why}{self._cut(result, cfg)}",
            f"|loss - ln V| <= {margin} nats", metrics={**ev, "ln_v": ln_v, "gap": gap, "steps": result.steps_done},
            curves={"train loss": self._losses(result)}, wall_s=time.monotonic() - t0, planted=planted)

    def long_range(self, leak: str = "none", planted: str | None = None) -> SentinelResult:
        t0 = time.monotonic()
        base = {**self.profile.long_range, "data.source": "synthetic", "data.synthetic.task": "needle_recall",
                "model.debug.leak": leak}
        out, curves = {}, {}
        for arm, override in (("full", "none"), ("locals_only", "locals_only")):
            cfg = self._config(self.probe_config, {**base, "model.debug.gate_override": override})
            trainer, result = self._train(cfg)
            out[arm] = self._evaluate(trainer, cfg, self.profile.eval_batches)
            out[arm]["steps"] = result.steps_done
            curves[f"{arm} answer loss"] = self._losses(result)
        chance = math.log(cfg.data.synthetic.n_values)
        full_ok = out["full"]["eval_loss"] <= thresholds.LONG_RANGE_FULL_MAX_ANSWER_LOSS
        local_ok = out["locals_only"]["eval_loss"] >= chance - thresholds.LONG_RANGE_LOCAL_MARGIN_NATS
        verdict = PASS if (full_ok and local_ok) else FAIL
        problems = []
        if not full_ok:
            problems.append("full NSA did not learn the recall: the compressed/selected branches are not wired")
        if not local_ok:
            problems.append("locals-only learned an answer outside its window: something sees beyond/after it")
        return SentinelResult(
            "long_range", verdict,
            f"answer loss full {out['full']['eval_loss']:.3f} (acc {out['full']['eval_accuracy']:.2f}), "
            f"locals-only {out['locals_only']['eval_loss']:.3f} (acc {out['locals_only']['eval_accuracy']:.2f}), "
            f"chance {chance:.3f}" + ("" if not problems else " - " + "; ".join(problems)),
            f"full <= {thresholds.LONG_RANGE_FULL_MAX_ANSWER_LOSS} nats; locals-only >= ln(n_values) - "
            f"{thresholds.LONG_RANGE_LOCAL_MARGIN_NATS}",
            metrics={"full": out["full"], "locals_only": out["locals_only"], "chance": chance},
            curves=curves, wall_s=time.monotonic() - t0, planted=planted)

    def real_text(self, *, leak: str = "none", gate_override: str = "none", steps: int | None = None,
                  planted: str | None = None, step_hook=None, slow_data_after: int | None = None,
                  synthetic: bool = False, base: str = "run", overrides: dict | None = None,
                  packing: str = "contiguous") -> list[SentinelResult]:
        """One training run on real text -> loss_floor, gate_collapse, watchdog verdicts. base: "run" (the
        config under test, with profile.real_text) or "probe" (the probe model, with `overrides`); synthetic:
        uniform tokens on the probe model instead (planted faults that need no text); packing "varlen": the
        documents packed with their boundaries (the verdicts' names end in _varlen)."""
        t0 = time.monotonic()
        suffix = "_varlen" if packing == "varlen" else ""
        names = [f"{name}{suffix}" for name in ("loss_floor", "gate_collapse", "watchdog")]
        if synthetic:  # planted-fault runs that need no text: the probe model on the random-label task
            base_cfg = self.probe_config
            overrides = {**self.profile.random_label, "data.source": "synthetic", "data.synthetic.task": "uniform"}
        elif self.corpus is None:
            return [SentinelResult(name, SKIP, "no real-text corpus (run `python -m sentinels prepare wiki` or "
                                   "install gensim)", "-", planted=planted) for name in names]
        else:
            base_cfg = self.run_config if base == "run" else self.probe_config
            overrides = {**(self.profile.real_text if overrides is None else overrides), "data.source": "jsonl",
                         "data.paths": [str(self.corpus)]}
        if packing == "varlen" and not packs_documents(base_cfg.model.attention):
            return [SentinelResult(name, SKIP, f"model.attention {base_cfg.model.attention!r}: its NSAAttention "
                                   "seams do not take cu_seqlens", "-", planted=planted) for name in names]
        overrides.update({"model.debug.leak": leak, "model.debug.gate_override": gate_override,
                          "data.packing": packing})
        if steps is not None:
            overrides["train.steps"] = steps
            overrides["train.warmup_steps"] = min(overrides.get("train.warmup_steps", 0), steps)
        cfg = self._config(base_cfg, overrides)
        batch_source = None
        if slow_data_after is not None:
            batch_source = SlowingBatchSource(BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=False),
                                              slow_after=slow_data_after)
        trainer, result = self._train(cfg, step_hook=step_hook, batch_source=batch_source)
        wall = time.monotonic() - t0
        losses = self._losses(result)
        kinds = [e.kind for e in result.events]
        cut = self._cut(result, cfg)
        curves = {"train loss": losses}

        floor_events = [e for e in result.events if e.kind == "loss_floor"]
        finite = [x for x in losses if math.isfinite(x)]
        floor = SentinelResult(
            names[0], FAIL if floor_events else PASS,
            (floor_events[0].message if floor_events else
             f"min step loss {min(finite) if finite else float('nan'):.4f} >= floor "
             f"{cfg.monitors.loss_floor.threshold} over {result.steps_done} steps") + cut,
            f"no step loss < {cfg.monitors.loss_floor.threshold} nats before step {cfg.monitors.loss_floor.before_step}",
            metrics={"min_loss": min(finite) if finite else None, "final_loss": losses[-1] if losses else None,
                     "steps": result.steps_done, "data_quality": _quality(trainer)},
            curves=curves, wall_s=wall, planted=planted)

        collapse = [e for e in result.events if e.kind == "gate_collapse"]
        gate_values = [r[f"gate_mean_{b}"] for r in result.records for b in ("cmp", "slc", "win")]
        stats_ok = len(result.records) > 0 and all(math.isfinite(g) and 0.0 <= g <= 1.0 for g in gate_values)
        last = result.records[-1] if result.records else {}
        gate_summary = ", ".join(f"{b} {last.get(f'gate_mean_{b}', float('nan')):.3f}" for b in ("cmp", "slc", "win"))
        gate = SentinelResult(
            names[1], FAIL if (collapse or not stats_ok) else PASS,
            (("; ".join(e.message for e in collapse[:3])) if collapse else
             ("gate statistics missing or outside [0, 1]" if not stats_ok else
              f"final mean gates {gate_summary}; no collapse in {result.steps_done} steps")) + cut,
            f"no layer/branch mean gate outside [{cfg.monitors.gate_collapse.low}, {cfg.monitors.gate_collapse.high}]"
            f" for > {cfg.monitors.gate_collapse.steps} steps",
            metrics={"final_gate_mean": {b: last.get(f"gate_mean_{b}") for b in ("cmp", "slc", "win")},
                     "events": len(collapse), "sel_distinct_blocks": last.get("sel_distinct_blocks"),
                     "reads_total": last.get("reads_total")},
            curves={"gate mean cmp": [r["gate_mean_cmp"] for r in result.records],
                    "gate mean slc": [r["gate_mean_slc"] for r in result.records],
                    "gate mean win": [r["gate_mean_win"] for r in result.records]},
            wall_s=wall, planted=planted)

        hard = [e for e in result.events if e.kind in ("nonfinite", "zero_grad", "heartbeat_stall")]
        soft = [e for e in result.events if e.kind in ("throughput_drop", "fetch_slowdown", "data_fallback")]
        tps = [r["tokens_per_s"] for r in (result.records[2:] or result.records)] or [0.0]
        watchdog = SentinelResult(
            names[2], FAIL if hard else (WARN if soft else PASS),
            ("; ".join(e.message for e in (hard + soft)[:3]) if (hard or soft) else
             f"no events; median tokens/s {sorted(tps)[len(tps) // 2]:.0f}") + cut,
            "FAIL: non-finite/zero grad, heartbeat stall; WARN: tokens/s drop > "
            f"{cfg.monitors.watchdog.throughput_drop:.0%} for {cfg.monitors.watchdog.throughput_drop_steps} steps, "
            f"dt_fetch > {cfg.monitors.watchdog.fetch_growth}x baseline",
            metrics={"events": kinds, "median_tokens_per_s": sorted(tps)[len(tps) // 2],
                     "peak_mem_allocated_mib": max((r["mem_allocated_mib"] or 0) for r in result.records)
                     if result.records else None},
            curves={"tokens/s": [r["tokens_per_s"] for r in result.records]}, wall_s=wall, planted=planted)
        return [floor, gate, watchdog]

    # -- the whole profile ---------------------------------------------------------------------------
    def run_all(self, *, selftest: bool = True,
                on_progress: Callable[[list[SentinelResult], list[SentinelResult]], None] | None = None,
                ) -> tuple[list[SentinelResult], list[SentinelResult]]:
        """Every sentinel, then the self-test; on_progress(results, planted) after each step (partial reports)."""
        results: list[SentinelResult] = []
        plan: list[tuple[str, Callable[[], list[SentinelResult]]]] = [
            ("label_shift", lambda: [self.label_shift()]),
            ("doc_isolation", lambda: [self.doc_isolation()]),
            ("random_label", lambda: [self.random_label()]),
            ("long_range", lambda: [self.long_range()]),
            ("real_text", lambda: self.real_text()),
            ("real_text varlen", lambda: self.real_text(packing="varlen")),
        ]
        selftests: list[tuple[str, str, Callable[[], list[SentinelResult]]]] = []
        if selftest:
            collapse_steps = self.profile.gate_collapse_plant_steps
            selftests = [
                ("leak: kv_next_token", "random_label",
                 lambda: [self.random_label(leak="kv_next_token", planted="kv_next_token")]),
                ("leak: cmp_block_early", "random_label",
                 lambda: [self.random_label(leak="cmp_block_early", planted="cmp_block_early")]),
                ("leak: kv_next_token on real text", "loss_floor",
                 lambda: self.real_text(leak="kv_next_token", base="probe", overrides=self.profile.loss_floor_plant,
                                        planted="kv_next_token")),
                ("labels misaligned", "label_shift",
                 lambda: [self.label_shift(make_batch=misaligned_batch, planted="labels == inputs")]),
                ("labels across document boundaries", "label_shift",
                 lambda: [self.label_shift(make_packed=cross_boundary_batch,
                                           planted="packed labels shifted over the whole row")]),
                ("leak: cross_document", "doc_isolation",
                 lambda: [self.doc_isolation(leak="cross_document", planted="cross_document")]),
                ("gates saturated", "gate_collapse",
                 lambda: self.real_text(gate_override="saturated", steps=collapse_steps, synthetic=True,
                                        planted="every gate = 1")),
                ("NaN weight", "watchdog",
                 lambda: self.real_text(steps=self.profile.watchdog_plant_steps, synthetic=True,
                                        step_hook=plant_nan_at(self.profile.watchdog_plant_steps // 2),
                                        planted="embedding row set to NaN")),
                ("data slowing down", "watchdog",
                 lambda: self.real_text(steps=self.profile.watchdog_plant_steps, synthetic=True,
                                        slow_data_after=self.profile.watchdog_plant_steps // 2,
                                        planted="each fetch sleeps 20 ms")),
            ]
        for name, fn in plan:
            self.log(f"[sentinels] {name} ...")
            try:
                results += fn()
            except BudgetExhausted as exc:
                results.append(SentinelResult(name, SKIP, str(exc), "-"))
            self.log(f"[sentinels]   {results[-1].name}: {results[-1].verdict} - {results[-1].summary}")
            if on_progress is not None:
                on_progress(results, [])
        planted_rows: list[SentinelResult] = []
        if not self.profile.loss_floor_plant:
            selftests = [t for t in selftests if t[1] != "loss_floor"]
        for label, target, fn in selftests:
            self.log(f"[selftest] {label} -> must trip {target} ...")
            try:
                rows = [r for r in fn() if r.name == target]
                row = rows[0]
            except BudgetExhausted as exc:
                row = SentinelResult(target, SKIP, str(exc), "-", planted=label)
            row.planted = label
            planted_rows.append(row)
            if on_progress is not None:
                on_progress(results, planted_rows)
            self.log(f"[selftest]   {'TRIPPED' if row.tripped else 'NOT TRIPPED'} ({row.verdict}) - {row.summary}")
        return results, planted_rows


def overall_verdict(results: list[SentinelResult], planted: list[SentinelResult]) -> str:
    if any(r.verdict == FAIL for r in results) or any(r.verdict in (PASS,) for r in planted):
        return FAIL
    if any(r.verdict == SKIP for r in results + planted):
        return "INCOMPLETE"
    return PASS


def misaligned_batch(windows: torch.Tensor) -> Batch:
    """A planted fault: labels equal to the inputs (no shift)."""
    return Batch(inputs=windows[:, :-1], labels=windows[:, :-1])


def cross_boundary_batch(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> Batch:
    """A planted fault: a packed row labelled like one contiguous window (each document's last position is
    labelled with the next document's first token)."""
    inputs = tokens.reshape(1, -1).long()
    labels = torch.cat([inputs[:, 1:], inputs[:, :1]], dim=1)
    return Batch(inputs=inputs, labels=labels, loss_mask=torch.ones(inputs.shape), cu_seqlens=cu_seqlens)


def isolation_lengths(cfg) -> list[int]:
    """The doc_isolation documents, from the NSA config (Eq. 7 l, Eq. 11 l', window w): shorter than one
    compressed block, one token, empty, exactly one selection block, past the window, several selection blocks,
    exactly one compressed block."""
    return [cfg.cmp_block - 1, 1, 0, cfg.sel_block, cfg.window_size + 3, 2 * cfg.sel_block + 5, cfg.cmp_block]


class _no_tf32:
    """fp32 matmuls without TF32 (the trainer turns it on for CUDA) while the isolation check runs."""

    def __enter__(self):
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def plant_nan_at(step: int):
    def hook(trainer: Trainer, at: int) -> None:
        if at == step:
            with torch.no_grad():
                trainer.model.embed.weight[0].fill_(float("nan"))
    return hook


class SlowingBatchSource:
    """A planted fault: after `slow_after` batches every fetch sleeps 20 ms more."""

    def __init__(self, inner, slow_after: int, delay_s: float = 0.02):
        self.inner, self.slow_after, self.delay_s = inner, slow_after, delay_s
        self.fetched = 0

    def next_batch(self) -> Batch:
        self.fetched += 1
        if self.fetched > self.slow_after:
            time.sleep(self.delay_s)
        return self.inner.next_batch()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def describe(self) -> dict:
        return {**self.inner.describe(), "planted": f"sleep {self.delay_s} s per fetch after {self.slow_after}"}


def _quality(trainer: Trainer) -> dict | None:
    primary = getattr(trainer.data, "primary", None)
    quality = getattr(primary, "quality", None)
    return quality.as_dict() if quality is not None else None
