"""The sentinel suite: short runs with named verdicts, and the sensitivity self-test with planted faults.

Sentinels, in the order they run (thresholds: sentinels/thresholds.py; docs/sentinels.md):
  causal_isolation  the run model, untrained: changing token t (or one branch's keys/values at t) moves no logit
                 at p < t, bitwise on CPU (sentinels/isolation.py); first because it needs no training and
                 catches a leak at any fraction of positions, layers, heads or branches, selection-only included
  label_shift    every pipeline batch satisfies labels[:, :-1] == inputs[:, 1:] (packed batches: the same shift
                 inside each document, the ignore label at its end); misaligned or boundary-crossing batches
                 are refused
  doc_isolation  packed documents (data.packing varlen) on the run model: changing one document's tokens moves no
                 logit of another document, and each document's logits equal those of the document run alone
  random_label   i.i.d. uniform tokens at a length where selection selects: the held-out loss, over all positions
                 and per position class (p mod d, l, l'), stays within RANDOM_LABEL_MARGIN_NATS of ln(V)
  causal_isolation_trained  causal_isolation again on the model random_label trained (non-trivial weights)
  long_range     needle recall beyond the window: full NSA learns it, locals-only (g_cmp = g_slc = 0) cannot
  loss_floor     real text: no step loss below the floor (the trainer's LossFloorMonitor)
  gate_collapse  real text: no branch gate pinned near 0 or 1 (GateCollapseMonitor); gate stats every step
  watchdog       real text: no non-finite/zero gradient or stalled heartbeat (FAIL); throughput or data-fetch
                 slowdowns are WARN (they depend on the machine's load)
  loss_floor_varlen, gate_collapse_varlen, watchdog_varlen: the real-text run again with data.packing varlen
Self-test: the same sentinels with planted faults must trip: the causal leaks of sentinels/plants.py, misaligned
labels, labels across document boundaries, a cross-document attention leak, saturated gates, a NaN weight and a
slowing data source.
"""

from __future__ import annotations

import contextlib
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
from .isolation import (check_causal_isolation, isolation_length, logits_of, no_tf32, probe_positions,
                        probes_for, summarize)
from .model import all_on_torch_path, build_model, lm_loss, on_torch_path, packs_documents
from .plants import PLANTS, Plant
from .profiles import SENTINELS, Profile
from .trainer import Trainer, TrainResult

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
NOT_APPLICABLE = "N/A"  # a planted row whose plant the model's path never reads (a seam a kernel replaces)
HELD_OUT_SEED_OFFSET = 1_000_003  # eval batches use another data seed than training



@dataclass
class SentinelResult:
    name: str
    verdict: str
    summary: str
    threshold: str
    metrics: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)  # label -> per-step values (see curve_units)
    wall_s: float = 0.0
    planted: str | None = None  # self-test rows: the planted fault; they pass when the sentinel trips
    incomplete: str | None = None  # why the verdict covers less than the profile asks for (overall INCOMPLETE)
    curve_units: str = "loss (nats)"  # the y axis of the plot: loss (nats), mean gate value, tokens/s
    curve_x: str = "training step"  # its x axis

    @property
    def tripped(self) -> bool:
        return self.verdict in (FAIL, WARN)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BudgetExhausted(RuntimeError):
    pass


class SentinelRunner:
    def __init__(self, profile: Profile, *, run_config: RunConfig, probe_config: RunConfig, work_dir: Path,
                 corpus: Path | None, budget_s: float | None = None, log: Callable[[str], None] = print,
                 seed: int | None = None):
        """seed: every run's train.seed and data.shuffle_seed, and the isolation checks' tokens and random
        positions (None: the configs' own seeds, and 0)."""
        self.profile = profile
        self.run_config, self.probe_config = run_config, probe_config
        self.work_dir = work_dir
        self.corpus = corpus
        self.seed = seed
        self.deadline = time.monotonic() + (budget_s if budget_s is not None else profile.budget_s)
        self.log = log
        self._run_no = 0

    # -- plumbing -------------------------------------------------------------------------------------
    @property
    def check_seed(self) -> int:
        return 0 if self.seed is None else self.seed

    def _config(self, base: RunConfig, overrides: dict[str, Any]) -> RunConfig:
        self._run_no += 1
        out_dir = self.work_dir / f"run{self._run_no:02d}"
        shutil.rmtree(out_dir, ignore_errors=True)
        fixed = {"train.device": self.profile.device, "train.precision": self.profile.precision,
                 "train.out_dir": str(out_dir), "train.save_every": 0}
        if self.seed is not None:
            fixed.update({"train.seed": self.seed, "data.shuffle_seed": self.seed})
        return base.replace(**{**overrides, **fixed})

    def _trainer(self, cfg: RunConfig, *, step_hook=None, batch_source=None, cap_s: float | None = None,
                 stop_after: int | None = None) -> Trainer:
        """A trainer whose run stops at cap_s (default: the profile's cap per run) or the end of the budget."""
        if time.monotonic() > self.deadline:
            raise BudgetExhausted("the profile's time budget is spent")
        cap_s = self.profile.run_cap_s if cap_s is None else cap_s
        run_deadline = min(self.deadline, time.monotonic() + cap_s)

        def hook(trainer: Trainer, step: int) -> None:
            if time.monotonic() > run_deadline:
                trainer.request_stop(f"time cap ({cap_s:.0f} s for this run, profile budget "
                                     f"{self.profile.budget_s:.0f} s)")
            if step_hook is not None:
                step_hook(trainer, step)

        return Trainer(cfg, step_hook=hook, batch_source=batch_source, console=False, save_checkpoints=False,
                       stop_after=stop_after)

    def _train(self, cfg: RunConfig, *, step_hook=None, batch_source=None, cap_s: float | None = None,
               stop_after: int | None = None) -> tuple[Trainer, TrainResult]:
        trainer = self._trainer(cfg, step_hook=step_hook, batch_source=batch_source, cap_s=cap_s,
                                stop_after=stop_after)
        result = trainer.train()
        trainer.close()
        return trainer, result

    @staticmethod
    def _losses(result: TrainResult) -> list[float]:
        return [r["loss"] for r in result.records]

    @staticmethod
    def _cut(result: TrainResult, trainer: Trainer) -> str:
        """A note when the run stopped before the step its trainer runs to (Trainer.last_step) for another reason
        than a monitor's own halt."""
        if result.steps_done >= trainer.last_step or (result.halt_reason or "").startswith("loss_floor"):
            return ""
        return f" (cut at step {result.steps_done}: {result.halt_reason})"

    @torch.no_grad()
    def _evaluate(self, trainer: Trainer, cfg: RunConfig, n_batches: int) -> dict[str, Any]:
        """Held-out loss (and accuracy at masked positions) on batches drawn with another data seed; for
        contiguous windows also the mean loss at each position (position_loss, T values)."""
        held_out = cfg.replace(**{"data.shuffle_seed": cfg.data.shuffle_seed + HELD_OUT_SEED_OFFSET})
        source = BatchSource(held_out, ShardSpec(0, 1), synthetic_on_fail=False)
        model = trainer.model
        was_training = model.training
        model.eval()
        losses, correct, counted = [], 0.0, 0.0
        per_position = None
        for _ in range(n_batches):
            batch = source.next_batch().to(trainer.device)
            with trainer._autocast():
                logits = model(batch.inputs, batch.cu_seqlens)
            losses.append(float(lm_loss(logits, batch.labels, batch.loss_mask)))
            hits = (logits.argmax(-1) == batch.labels).float()
            mask = torch.ones_like(hits) if batch.loss_mask is None else batch.loss_mask
            correct += float((hits * mask).sum())
            counted += float(mask.sum())
            if batch.loss_mask is None:
                ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), batch.labels, reduction="none")
                per_position = ce.sum(0) if per_position is None else per_position + ce.sum(0)
        model.train(was_training)
        out: dict[str, Any] = {"eval_loss": sum(losses) / len(losses), "eval_accuracy": correct / counted}
        if per_position is not None:
            out["position_loss"] = (per_position / (n_batches * cfg.train.micro_batch_size)).tolist()
        return out

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


    def causal_isolation(self, plant: Plant | None = None, *, planted: str | None = None,
                         torch_path: bool = False) -> SentinelResult:
        """The run model, untrained, at the run's geometry (T > n*l' + w; several documents when the run config
        packs them): changing token t, or only one branch's keys/values at t, moves no logit at p < t.

        A seam plant (a replaced visibility or scoring rule of optimized.masks) that the model's path does not
        apply (on CUDA the kernels compute those rules themselves) is run again with every attention layer on
        the torch path (torch_path: backend and range_backend "torch"), which applies the rules through the
        seams: the row then says which path tripped, and stays not applicable only if that path ignores the
        plant too."""
        t0 = time.monotonic()
        cfg = self.run_config.replace(**(plant.overrides if plant else {}))
        nsa = cfg.model.nsa_config()
        device = torch.device(self.profile.device)
        torch.manual_seed(self.check_seed)
        model = build_model(cfg).to(device)
        if torch_path:
            on_torch_path(model)
        T = isolation_length(nsa, cfg.train.seq_len)
        cu_seqlens = None
        if cfg.data.packing == "varlen" and packs_documents(cfg.model.attention):
            lengths = [nsa.sel_block + 3, T, nsa.cmp_block - 1]  # a short document, one at the run's length, a stub
            cu_seqlens = cu_seqlens_of(lengths, device)
            T = sum(lengths)
        vocab = cfg.vocab_size()
        gen = torch.Generator().manual_seed(self.check_seed)
        tokens = torch.randint(0, vocab, (1, T), generator=gen).to(device)
        probes = probes_for(probe_positions(nsa, T, n_random=self.profile.isolation_random_positions,
                                            seed=self.check_seed))
        precision = self.profile.precision
        planted_logits = None
        with _installed(plant, model) as handle:
            out = check_causal_isolation(model, tokens, probes=probes, vocab=vocab, precision=precision,
                                         cu_seqlens=cu_seqlens, rows_per_forward=self.profile.isolation_rows,
                                         stop_at_first=plant is not None)
            if plant is not None and plant.seams and not out.leaked:  # was the replaced rule applied at all?
                planted_logits = logits_of(model, tokens, cu_seqlens, precision)
        changed = None
        if planted_logits is not None:
            clean = logits_of(model, tokens, cu_seqlens, precision)
            changed = float((planted_logits - clean).abs().max()) / max(out.scale, 1e-30) > out.bound_rel
        result = self._isolation_result("causal_isolation", out, handle, planted, t0, changed=changed)
        if result.verdict == NOT_APPLICABLE and not torch_path and not all_on_torch_path(model):
            retry = self.causal_isolation(plant, planted=planted, torch_path=True)
            retry.summary = (f"on the torch path (backend and range_backend 'torch'; the default path does not "
                             f"apply the plant: {result.summary}) - {retry.summary}")
            retry.wall_s += result.wall_s
            return retry
        return result

    def _isolation_result(self, name: str, out, handle, planted: str | None, t0: float, *,
                          changed: bool | None = None) -> SentinelResult:
        """changed: for a seam plant that did not trip, whether the replaced rule changed the model's logits at
        all (False: this path does not apply it, e.g. a kernel computes the rule itself)."""
        verdict = FAIL if (out.leaked or out.inert_token_probes) else PASS
        summary = summarize(out)
        if handle is not None and (not handle.reached or changed is False):
            verdict = NOT_APPLICABLE
            if not handle.reached:
                what = (f"the replaced seam(s) {', '.join(handle.uncalled)} of optimized.masks never called"
                        + ("" if len(handle.uncalled) == len(handle.plant.seams) else
                           f" (the plant is a leak only with all of {', '.join(sorted(handle.plant.seams))})"))
            else:
                what = (f"the replaced seam(s) {', '.join(sorted(handle.plant.seams))} of optimized.masks were "
                        f"called {handle.calls} times, but the logits are those of the unplanted model")
            summary = f"{what}: this path computes the rule itself, the plant is not applied - " + summary
        threshold = ("every logit at p < t unchanged (bitwise on CPU; on CUDA within "
                     f"{thresholds.CAUSAL_ISOLATION_CUDA_NOISE_FACTOR:g}x the control rows' difference)")
        metrics = out.as_dict()
        if handle is not None:
            metrics["seam_calls"] = handle.calls
        return SentinelResult(name, verdict, summary, threshold, metrics=metrics, wall_s=time.monotonic() - t0,
                              planted=planted, curve_units="", curve_x="")

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
        torch.manual_seed(self.check_seed if self.seed is not None else cfg.train.seed)
        model = build_model(cfg).to(device).eval()
        lengths = isolation_lengths(cfg.model.nsa_config())
        cu = cu_seqlens_of(lengths, device)
        spans = [(a, b) for a, b in check_cu_seqlens(cu, sum(lengths), 1) if b > a]
        vocab = cfg.vocab_size()
        tokens = torch.randint(0, vocab, (1, sum(lengths)),
                               generator=torch.Generator().manual_seed(self.check_seed)).to(device)
        alone_diff, perturb_diff, own_change = 0.0, 0.0, float("inf")
        with torch.no_grad(), no_tf32():
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

    def random_label(self, plant: Plant | None = None, *, planted: str | None = None,
                     trained_isolation: bool = True, stop_on_trip: bool | None = None) -> list[SentinelResult]:
        """The probe model on i.i.d. uniform tokens at a length where selection selects (T well above n*l'):
        held-out loss evaluated every eval_every steps, over all positions and per position class (p mod s for
        the block sizes s = d, l, l'); any evaluation below ln V - margin is a leak. A planted run stops once it
        trips (stop_on_trip, default: with a plant). Then (trained_isolation) causal_isolation_trained on the
        trained model."""
        stop_on_trip = plant is not None if stop_on_trip is None else stop_on_trip
        t0 = time.monotonic()
        cfg = self._config(self.probe_config, {**self.profile.random_label, "data.source": "synthetic",
                                               "data.synthetic.task": "uniform", **(plant.overrides if plant else {})})
        ln_v = math.log(cfg.data.synthetic.vocab_size)
        margin = thresholds.RANDOM_LABEL_MARGIN_NATS
        nsa = cfg.model.nsa_config()
        evals: list[dict[str, Any]] = []

        def evaluate(trainer: Trainer, step: int) -> dict[str, Any]:
            ev = self._evaluate(trainer, cfg, self.profile.eval_batches)
            ev.update(step=step, gap=ev["eval_loss"] - ln_v, **worst_position_class(ev.pop("position_loss"), ln_v,
                                                                                  nsa))
            evals.append(ev)
            return ev

        def hook(trainer: Trainer, step: int) -> None:
            if step and step % self.profile.random_label_eval_every == 0:
                ev = evaluate(trainer, step)
                if stop_on_trip and min(ev["gap"], ev["class_gap"]) < -margin:
                    trainer.request_stop(f"tripped at step {step}")

        trainer = self._trainer(cfg, step_hook=hook)
        with _installed(plant, trainer.model) as handle:
            result = trainer.train()
            trainer.close()
            final = evaluate(trainer, result.steps_done)
            isolation = None
            if trained_isolation:
                t1 = time.monotonic()
                seq = cfg.train.seq_len
                tokens = torch.randint(0, cfg.vocab_size(), (1, seq),
                                       generator=torch.Generator().manual_seed(self.check_seed)).to(trainer.device)
                probes = probes_for(probe_positions(nsa, seq, n_random=self.profile.isolation_random_positions,
                                                    seed=self.check_seed))
                out = check_causal_isolation(trainer.model, tokens, probes=probes, vocab=cfg.vocab_size(),
                                             precision=self.profile.precision,
                                             rows_per_forward=self.profile.isolation_rows,
                                             stop_at_first=plant is not None)
                isolation = self._isolation_result("causal_isolation_trained", out, handle, planted, t1)
                isolation.summary = f"after {result.steps_done} random-label steps: " + isolation.summary
        leaks = [ev for ev in evals if min(ev["gap"], ev["class_gap"]) < -margin]
        no_marginal = final["gap"] > margin
        verdict = FAIL if (leaks or no_marginal) else PASS
        if leaks:
            ev = leaks[0]
            worst = ("all positions", ev["gap"]) if ev["gap"] <= ev["class_gap"] else (ev["class"], ev["class_gap"])
            why = (f" - at step {ev['step']} the held-out loss of {worst[0]} is {worst[1]:+.4f} nats from ln V: "
                   "the model predicts random labels, it sees them (leak)")
        elif no_marginal:
            why = " - above ln V: the model did not even learn the marginal"
        else:
            why = ""
        stopped = f" (stopped at step {result.steps_done} once tripped)" if stop_on_trip and leaks else ""
        cut = "" if stopped else self._cut(result, trainer)
        rows = [SentinelResult(
            "random_label", verdict,
            f"held-out loss {final['eval_loss']:.4f} vs ln V {ln_v:.4f} (gap {final['gap']:+.4f}; worst position "
            f"class {final['class']} {final['class_gap']:+.4f}) at T={cfg.train.seq_len} after "
            f"{result.steps_done} steps{why}{stopped}{cut}",
            f"every {self.profile.random_label_eval_every} steps: held-out loss - ln V >= -{margin} nats over all "
            f"positions and per position class (p mod d, l, l'); at the end <= +{margin}",
            metrics={**{k: v for k, v in final.items()}, "ln_v": ln_v, "steps": result.steps_done,
                     "seq_len": cfg.train.seq_len, "first_trip_step": leaks[0]["step"] if leaks else None,
                     "evals": [{k: ev[k] for k in ("step", "gap", "class", "class_gap")} for ev in evals]},
            curves={"train loss": self._losses(result),
                    "held-out loss": _at_steps(evals, "eval_loss", result.steps_done),
                    "held-out loss, worst position class": _at_steps(evals, "class_loss", result.steps_done)},
            wall_s=time.monotonic() - t0, planted=planted)]
        if isolation is not None:
            rows.append(isolation)
        return rows

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
        if synthetic:  # planted-fault runs that need no text: the probe model on uniform tokens
            base_cfg = self.probe_config
            overrides = {**self.profile.plant_run, "data.source": "synthetic", "data.synthetic.task": "uniform"}
        elif self.corpus is None:
            return [SentinelResult(name, SKIP, "no real-text corpus (run `python -m sentinels prepare wiki` or "
                                   "install gensim)", "-", planted=planted) for name in names]
        else:
            base_cfg = self.run_config if base == "run" else self.probe_config
            if overrides is None:
                overrides = (self.profile.real_text_varlen or self.profile.real_text) if packing == "varlen" \
                    else self.profile.real_text
            overrides = {**overrides, "data.source": "jsonl", "data.paths": [str(self.corpus)]}
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
        under_test = base == "run" and not synthetic and planted is None
        cap_s = self.profile.real_text_cap_s if under_test and packing == "contiguous" else None
        # the launch's own schedule, its first steps (unless the caller set the steps)
        first_steps = (self.profile.real_text_first_steps.get(packing)
                       if base == "run" and not synthetic and steps is None else None)
        trainer, result = self._train(cfg, step_hook=step_hook, batch_source=batch_source, cap_s=cap_s,
                                      stop_after=first_steps)
        wall = time.monotonic() - t0
        losses = self._losses(result)
        kinds = [e.kind for e in result.events]
        cut = self._cut(result, trainer)
        curves = {"train loss": losses}
        incomplete = None
        min_steps = self.profile.real_text_min_steps if packing == "contiguous" else 0
        if under_test and result.steps_done < min_steps and not (result.halt_reason or "").startswith("loss_floor"):
            incomplete = (f"judged over {result.steps_done} steps, the profile asks for >= {min_steps} (a slow leak "
                          "may show later)")
            cut += f" - {incomplete}"

        floor_events = [e for e in result.events if e.kind == "loss_floor"]
        finite = [x for x in losses if math.isfinite(x)]
        floor = SentinelResult(
            names[0], FAIL if floor_events else PASS,
            (floor_events[0].message if floor_events else
             f"min step loss {min(finite) if finite else float('nan'):.4f} >= floor "
             f"{cfg.monitors.loss_floor.threshold} over {result.steps_done} steps") + cut,
            f"no step loss < {cfg.monitors.loss_floor.threshold} nats before step "
            f"{cfg.monitors.loss_floor.before_step}",
            metrics={"min_loss": min(finite) if finite else None, "final_loss": losses[-1] if losses else None,
                     "steps": result.steps_done, "data_quality": _quality(trainer)},
            curves=curves, wall_s=wall, planted=planted, incomplete=incomplete)

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
            wall_s=wall, planted=planted, incomplete=incomplete, curve_units="mean gate value (0 to 1)")

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
            curves={"tokens/s": [r["tokens_per_s"] for r in result.records]}, wall_s=wall, planted=planted,
            incomplete=incomplete, curve_units="tokens/s")
        return [floor, gate, watchdog]

    # -- the whole profile ---------------------------------------------------------------------------

    # -- the whole profile ---------------------------------------------------------------------------
    def plan(self, selftest: bool = True) -> tuple[list, list]:
        """(sentinel steps, self-test rows): steps are (label, the names they produce, fn -> results); rows are
        (label, the sentinel that must trip, fn -> results)."""
        steps: list[tuple[str, tuple[str, ...], Callable[[], list[SentinelResult]]]] = [
            ("causal_isolation", ("causal_isolation",), lambda: [self.causal_isolation()]),
            ("label_shift", ("label_shift",), lambda: [self.label_shift()]),
            ("doc_isolation", ("doc_isolation",), lambda: [self.doc_isolation()]),
            ("random_label", ("random_label", "causal_isolation_trained"), lambda: self.random_label()),
            ("long_range", ("long_range",), lambda: [self.long_range()]),
            ("real_text", ("loss_floor", "gate_collapse", "watchdog"), lambda: self.real_text()),
            ("real_text varlen", ("loss_floor_varlen", "gate_collapse_varlen", "watchdog_varlen"),
             lambda: self.real_text(packing="varlen")),
        ]
        if not selftest:
            return steps, []
        rows: list[tuple[str, tuple[str, ...], Callable[[], list[SentinelResult]]]] = []
        for name in self.profile.isolation_plants:
            rows.append((f"leak: {name}", ("causal_isolation",),
                         lambda p=PLANTS[name]: [self.causal_isolation(p, planted=p.name)]))
        trained = self.profile.trained_isolation_plants
        for name in dict.fromkeys(self.profile.random_label_plants + trained):  # one run gives both rows
            targets = (("random_label",) if name in self.profile.random_label_plants else ()) + \
                (("causal_isolation_trained",) if name in trained else ())
            rows.append((f"leak: {name}", targets,
                         lambda p=PLANTS[name]: self.random_label(p, planted=p.name,
                                                                  trained_isolation=p.name in trained)))
        collapse_steps = self.profile.gate_collapse_plant_steps
        if self.profile.loss_floor_plant:
            rows.append(("leak: kv_next_token on real text", ("loss_floor",),
                         lambda: self.real_text(leak="kv_next_token", base="probe",
                                                overrides=self.profile.loss_floor_plant, planted="kv_next_token")))
        rows += [
            ("labels misaligned", ("label_shift",),
             lambda: [self.label_shift(make_batch=misaligned_batch, planted="labels == inputs")]),
            ("labels across document boundaries", ("label_shift",),
             lambda: [self.label_shift(make_packed=cross_boundary_batch,
                                       planted="packed labels shifted over the whole row")]),
            ("leak: cross_document", ("doc_isolation",),
             lambda: [self.doc_isolation(leak="cross_document", planted="cross_document")]),
            ("gates saturated", ("gate_collapse",),
             lambda: self.real_text(gate_override="saturated", steps=collapse_steps, synthetic=True,
                                    planted="every gate = 1")),
            ("NaN weight", ("watchdog",),
             lambda: self.real_text(steps=self.profile.watchdog_plant_steps, synthetic=True,
                                    step_hook=plant_nan_at(self.profile.watchdog_plant_steps // 2),
                                    planted="embedding row set to NaN")),
            ("data slowing down", ("watchdog",),
             lambda: self.real_text(steps=self.profile.watchdog_plant_steps, synthetic=True,
                                    slow_data_after=self.profile.watchdog_plant_steps // 2,
                                    planted="each fetch sleeps 20 ms")),
        ]
        return steps, rows

    def run_all(self, *, selftest: bool = True, only: set[str] | None = None,
                on_progress: Callable[[list[SentinelResult], list[SentinelResult]], None] | None = None,
                ) -> tuple[list[SentinelResult], list[SentinelResult]]:
        """Every sentinel (or those named in `only`), then the self-test rows whose sentinel runs;
        on_progress(results, planted) after each step (partial reports)."""
        steps, rows = self.plan(selftest)
        if only is not None:
            unknown = sorted(only - set(SENTINELS))
            if unknown:
                raise ValueError(f"--only: unknown sentinel(s) {unknown}; choose from {list(SENTINELS)}")
            steps = [s for s in steps if only & set(s[1])]
            rows = [(label, tuple(t for t in targets if t in only), fn) for label, targets, fn in rows
                    if only & set(targets)]
        results: list[SentinelResult] = []
        for label, names, fn in steps:
            self.log(f"[sentinels] {label} ...")
            try:
                produced = [r for r in fn() if only is None or r.name in only]
            except BudgetExhausted as exc:
                produced = [SentinelResult(name, SKIP, str(exc), "-") for name in names
                            if only is None or name in only]
            results += produced
            for r in produced:
                self.log(f"[sentinels]   {r.name}: {r.verdict} - {r.summary}")
            if on_progress is not None:
                on_progress(results, [])
        planted_rows: list[SentinelResult] = []
        for label, targets, fn in rows:
            self.log(f"[selftest] {label} -> must trip {', '.join(targets)} ...")
            try:
                produced = {r.name: r for r in fn()}
                got = [produced[target] for target in targets]
            except BudgetExhausted as exc:
                got = [SentinelResult(target, SKIP, str(exc), "-") for target in targets]
            for row in got:
                row.planted = label
                planted_rows.append(row)
                state = ("TRIPPED (expected)" if row.tripped else
                         "NOT APPLICABLE" if row.verdict == NOT_APPLICABLE else "NOT TRIPPED")
                self.log(f"[selftest]   {row.name}: {state} ({row.verdict}) - {row.summary}")
            if on_progress is not None:
                on_progress(results, planted_rows)
        return results, planted_rows


def overall_verdict(results: list[SentinelResult], planted: list[SentinelResult]) -> str:
    """FAIL: a sentinel FAILs or a planted fault did not trip its sentinel; INCOMPLETE: a run was skipped or
    covered less than the profile asks; PASS otherwise. Planted rows the model's path cannot carry (N/A) count
    neither way."""
    if any(r.verdict == FAIL for r in results) or any(r.verdict == PASS for r in planted):
        return FAIL
    if any(r.verdict == SKIP for r in results + planted) or any(r.incomplete for r in results):
        return "INCOMPLETE"
    return PASS


def worst_position_class(position_loss: list[float], ln_v: float, nsa) -> dict[str, Any]:
    """The position class (p mod s == r, for the block sizes s = d, l, l') with the lowest mean held-out loss. A
    leak confined to some block offsets (e.g. the query i*d + l - 1 that reads a block one token early) shows
    there s times stronger than in the mean over all positions."""
    loss = torch.tensor(position_loss, dtype=torch.float64)
    worst = ("all positions", float(loss.mean()))
    for size in sorted({nsa.cmp_stride, nsa.cmp_block, nsa.sel_block}):
        if size >= len(position_loss):
            continue
        for r in range(size):
            mean = float(loss[r::size].mean())
            if mean < worst[1]:
                worst = (f"p % {size} == {r}", mean)
    return {"class": worst[0], "class_loss": worst[1], "class_gap": worst[1] - ln_v}


def _at_steps(evals: list[dict[str, Any]], key: str, steps: int) -> list[float]:
    """A per-step curve from the evaluations (NaN between them), for the report's plots."""
    curve = [float("nan")] * (steps + 1)
    for ev in evals:
        if ev["step"] <= steps:
            curve[ev["step"]] = ev[key]
    return curve


@contextlib.contextmanager
def _installed(plant: Plant | None, model: torch.nn.Module):
    if plant is None:
        yield None
        return
    with plant.installed(model) as handle:
        yield handle


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
