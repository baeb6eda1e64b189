"""Config preflight: the rules a run config must pass before a launch (thresholds in policy.py).

`check_config` is a pure function of the config and injected facts (is a GPU visible, is this a resume, where
relative paths resolve, how the tokenizer and the parameter count are obtained), so each rule is testable on CPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from ..config import RunConfig
from . import policy


@dataclass(frozen=True)
class Finding:
    rule: str  # short rule name: device, precision, save_every, out_dir, model_size, attention, tokenizer, ...
    message: str  # why the config is refused, naming the config key


@dataclass(frozen=True)
class ConfigVerdict:
    config_hash: str
    findings: tuple[Finding, ...]  # empty when the config passes
    parameters: int

    @property
    def ok(self) -> bool:
        return not self.findings


def tokenizer_problem(name: str) -> str | None:
    """None when the tokenizer `name` loads from local files, else why it does not."""
    from ..data.tokenizers import TokenizerUnavailable, get_tokenizer

    try:
        get_tokenizer(name)
    except (TokenizerUnavailable, ImportError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def module_problem(name: str) -> str | None:
    """None when the module `name` can be imported (found without importing it), else why not."""
    return None if importlib.util.find_spec(name) is not None else f"the Python package {name!r} is not installed"


def count_parameters(cfg: RunConfig) -> int:
    from ..model import count_parameters_for

    return count_parameters_for(cfg)


def is_long_run(cfg: RunConfig) -> bool:
    return cfg.train.steps >= policy.LONG_RUN_STEPS


def check_config(cfg: RunConfig, *, gpu_visible: bool, resume: bool, cwd: Path | None = None,
                 tokenizer_check: Callable[[str], str | None] = tokenizer_problem,
                 module_check: Callable[[str], str | None] = module_problem,
                 parameter_count: Callable[[RunConfig], int] = count_parameters) -> ConfigVerdict:
    """Every rule that refuses `cfg` for a launch; relative paths resolve against `cwd` (default: the current
    directory, as the trainer resolves train.out_dir)."""
    cwd = Path.cwd() if cwd is None else cwd
    t, long_run = cfg.train, is_long_run(cfg)
    out: list[Finding] = []

    on_gpu = t.device == "cuda" or (t.device == "auto" and gpu_visible)
    if t.device == "cuda" and not gpu_visible:
        out.append(Finding("device", "train.device is 'cuda' but no CUDA device is visible"))
    if long_run and not on_gpu:
        out.append(Finding("device", f"a long run ({t.steps} steps >= {policy.LONG_RUN_STEPS}) would train on the "
                                     f"CPU (train.device={t.device!r}, GPU visible: {gpu_visible})"))
    if on_gpu and t.precision != "bf16":
        out.append(Finding("precision", f"train.precision is {t.precision!r} but the run trains on the GPU: "
                                        f"launches train in bf16 autocast (set train.precision: bf16)"))

    if long_run:
        limit = t.steps // policy.MIN_CHECKPOINTS_PER_LONG_RUN
        if t.save_every == 0 or t.save_every * policy.MIN_CHECKPOINTS_PER_LONG_RUN > t.steps:
            what = "0 (a checkpoint only at the end)" if t.save_every == 0 else str(t.save_every)
            out.append(Finding("save_every", f"train.save_every is {what} for a {t.steps}-step run: a long run must "
                                             f"checkpoint at least every steps/{policy.MIN_CHECKPOINTS_PER_LONG_RUN}"
                                             f" = {limit} steps"))

    out_dir = Path(t.out_dir) if Path(t.out_dir).is_absolute() else cwd / t.out_dir
    if out_dir.exists() and not out_dir.is_dir():
        out.append(Finding("out_dir", f"train.out_dir {t.out_dir} exists and is not a directory"))
    elif resume:
        if not (out_dir / "checkpoints" / "latest.json").is_file():
            out.append(Finding("out_dir", f"resuming, but train.out_dir {t.out_dir} holds no checkpoint "
                                          f"(checkpoints/latest.json is missing)"))
    elif out_dir.is_dir():
        entries = sorted(p.name for p in out_dir.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            out.append(Finding("out_dir", f"train.out_dir {t.out_dir} is not empty ({len(entries)} entries: {shown})"
                                          f": choose a new out_dir, or resume it (--resume)"))

    parameters = parameter_count(cfg)
    if long_run and parameters < policy.TOY_MODEL_MAX_PARAMETERS:
        out.append(Finding("model_size", f"a long run ({t.steps} steps) of a toy model: {parameters:,} parameters < "
                                         f"{policy.TOY_MODEL_MAX_PARAMETERS:,} (model.d_model={cfg.model.d_model}, "
                                         f"model.n_layers={cfg.model.n_layers})"))
    if long_run and cfg.model.attention != "optimized":
        out.append(Finding("attention", f"model.attention is {cfg.model.attention!r} for a long run: the loop "
                                        f"reference is the oracle, not a training path (use 'optimized')"))

    if cfg.data.source != "synthetic":
        problem = tokenizer_check(cfg.data.tokenizer)
        if problem is not None:
            out.append(Finding("tokenizer", f"data.tokenizer {cfg.data.tokenizer!r} is not available: {problem}"))
    if cfg.data.source in ("jsonl", "text"):
        for i, name in enumerate(cfg.data.paths):
            path = Path(name) if Path(name).is_absolute() else cwd / name
            if not path.is_file():
                out.append(Finding("data", f"data.paths[{i}] {name} is not a file"))
    if cfg.data.source == "fineweb":
        problem = module_check("datasets")
        if problem is not None:
            out.append(Finding("data", f"data.source 'fineweb' streams through `datasets`: {problem}"))

    sel_block = cfg.model.nsa_config().sel_block
    if t.seq_len % sel_block != 0:
        out.append(Finding("seq_len", f"train.seq_len {t.seq_len} is not a multiple of the selection block "
                                      f"l' = model.nsa.sel_block = {sel_block}"))

    debug = cfg.model.debug
    if debug.leak != "none" or debug.gate_override != "none":
        out.append(Finding("debug", f"model.debug plants a fault (leak={debug.leak!r}, gate_override="
                                    f"{debug.gate_override!r}): the sentinel self-test switches never launch"))
    return ConfigVerdict(config_hash=cfg.config_hash(), findings=tuple(out), parameters=parameters)


def format_config(cfg: RunConfig) -> str:
    """The resolved config as YAML and its hash (no rule applied)."""
    return "\n".join(["# resolved config", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
                      f"config hash: {cfg.config_hash()}",
                      f"long run:    {is_long_run(cfg)} ({cfg.train.steps} steps; long from {policy.LONG_RUN_STEPS})"])


def format_resolved(cfg: RunConfig, verdict: ConfigVerdict) -> str:
    """The resolved config as YAML, its hash, and the verdict with each refusal."""
    if verdict.config_hash != cfg.config_hash():
        raise ValueError("format_resolved: the verdict is for another config (its config_hash differs)")
    lines = [format_config(cfg), f"parameters:  {verdict.parameters:,}"]
    if verdict.ok:
        lines.append("config: PASS")
    else:
        lines.append("config: REFUSED")
        lines += [f"  - [{f.rule}] {f.message}" for f in verdict.findings]
    return "\n".join(lines)
