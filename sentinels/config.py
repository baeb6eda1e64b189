"""Typed run configuration: YAML files under configs/ parsed into frozen dataclasses.

Every key is checked: an unknown key, a wrong type or a value outside its rule raises ConfigError naming the
full dotted key (e.g. ``train.save_every``). The fields a launch preflight needs (precision, save_every, steps,
out_dir, model size, tokenizer, seq_len) are plain typed fields here, and `RunConfig.summary()` collects them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from reference.config import NSAConfig

from . import thresholds
from .errors import InputError


class ConfigError(InputError, ValueError):
    """A run config key is unknown, has the wrong type, or breaks a rule (the message names the key)."""


ATTENTION_IMPLS = ("optimized", "reference")
DEBUG_LEAKS = ("none", "kv_next_token", "cmp_block_early", "cmp_one_early", "win_next_token", "slc_values_next_token",
               "slc_block_end", "sel_scores_next_block", "cross_document")
LEAK_SCOPES = ("all", "last_layer", "one_head")
PACKINGS = ("contiguous", "varlen")
GATE_OVERRIDES = ("none", "locals_only", "saturated")
DATA_SOURCES = ("synthetic", "jsonl", "text", "fineweb")
SYNTHETIC_TASKS = ("uniform", "needle_recall")
TOKENIZERS = ("byte", "gpt2")
PRECISIONS = ("bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
PARALLELS = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = (False, True, "attention")


def _one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    """value equals one of allowed and has its type (1 is not true, true is not 1)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def _require(cond: bool, key: str, rule: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: {rule} (got {value!r})")


@dataclass(frozen=True)
class DebugConfig:
    """DEBUG switches that plant faults for the sentinel self-test. Never set them in a real run."""

    leak: Literal["none", "kv_next_token", "cmp_block_early", "cmp_one_early", "win_next_token",
                  "slc_values_next_token", "slc_block_end", "sel_scores_next_block", "cross_document"] = "none"
    # kv_next_token: every branch's keys/values at position p are those of p+1 (attention sees the next token).
    # cmp_block_early: the compressed branch's keys/values are shifted by cmp_stride positions, so compressed
    # block i (Eq. 7, visible once i*d+l-1 <= p) holds tokens up to i*d+l-1+d: it becomes visible d tokens early.
    # cmp_one_early: the compressed branch's keys/values are shifted by one position, so the query at
    # p = i*d+l-1 (one position in d) reads a block that holds token p+1.
    # win_next_token: the window branch's keys/values at p are those of p+1.
    # slc_values_next_token: the selected branch's values (not its keys) at p are those of p+1.
    # slc_block_end: the selected branch's keys/values at token s are those of the last token of s's selection
    # block, so a query inside block J reads block J's end, as if the block were not clipped to <= p.
    # sel_scores_next_block: Eq. 8-11 run on the compressed keys/values shifted by cmp_stride (the blocks are
    # scored on tokens up to d past their end); the layer then attends with the clean keys/values and those
    # blocks (teacher-forced indices): a leak into the selection only. Needs an attention module whose
    # functional_forward takes indices (optimized), and leak_scope all or last_layer.
    # cross_document (data.packing varlen): the NSA call gets no cu_seqlens, so attention runs over the whole
    # packed row and every document sees the documents packed before it.
    leak_scope: Literal["all", "last_layer", "one_head"] = "all"
    # where a leak applies: every layer and head, the last layer only, or query head 0 only (every layer)
    gate_override: Literal["none", "locals_only", "saturated"] = "none"
    # locals_only: g_cmp = g_slc = 0 (Eq. 5 keeps only the sliding window); saturated: every gate = 1.

    def validate(self, key: str) -> None:
        _require(self.leak in DEBUG_LEAKS, f"{key}.leak", f"must be one of {DEBUG_LEAKS}", self.leak)
        _require(self.leak_scope in LEAK_SCOPES, f"{key}.leak_scope", f"must be one of {LEAK_SCOPES}",
                 self.leak_scope)
        _require(self.leak != "sel_scores_next_block" or self.leak_scope != "one_head", f"{key}.leak_scope",
                 "must be all or last_layer with leak sel_scores_next_block (a selection is shared by a group's "
                 "heads)", self.leak_scope)
        _require(self.gate_override in GATE_OVERRIDES, f"{key}.gate_override",
                 f"must be one of {GATE_OVERRIDES}", self.gate_override)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM: token embedding, n_layers x (RMSNorm, NSA attention, RMSNorm, SwiGLU), RMSNorm, head."""

    d_model: int = 64
    n_layers: int = 2
    mlp_hidden: int = 176  # SwiGLU inner width
    tie_embeddings: bool = True
    attention: Literal["optimized", "reference"] = "optimized"
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    gate_hidden: int | None = None  # NSAAttention default (d_model) when null
    phi_hidden: int | None = None  # NSAAttention default (head_dim_qk) when null
    nsa: dict[str, Any] = field(default_factory=dict)  # NSAConfig fields (reference.config.NSAConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def validate(self, key: str) -> None:
        for name in ("d_model", "n_layers", "mlp_hidden"):
            _require(getattr(self, name) > 0, f"{key}.{name}", "must be > 0", getattr(self, name))
        for name in ("gate_hidden", "phi_hidden"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{key}.{name}", "must be null or > 0", value)
        _require(self.attention in ATTENTION_IMPLS, f"{key}.attention", f"must be one of {ATTENTION_IMPLS}",
                 self.attention)
        _require(self.debug.leak != "sel_scores_next_block" or self.attention == "optimized", f"{key}.debug.leak",
                 "sel_scores_next_block needs attention optimized (its forward takes teacher-forced indices)",
                 self.debug.leak)
        _require(self.norm_eps > 0, f"{key}.norm_eps", "must be > 0", self.norm_eps)
        _require(self.rope_base > 0, f"{key}.rope_base", "must be > 0", self.rope_base)
        try:
            self.nsa_config()
        except ValueError as exc:
            raise ConfigError(f"{key}.nsa: {exc}") from None
        self.debug.validate(f"{key}.debug")

    def nsa_config(self) -> NSAConfig:
        return NSAConfig.from_dict(dict(self.nsa))


@dataclass(frozen=True)
class SyntheticConfig:
    """Synthetic token tasks: i.i.d. uniform tokens, or needle recall (see sentinels/data/synthetic.py)."""

    task: Literal["uniform", "needle_recall"] = "uniform"
    vocab_size: int = 64  # token ids 0..vocab_size-1 (used when data.source is synthetic)
    n_values: int = 16  # needle_recall: number of distinct answer tokens (chance accuracy 1/n_values)
    # data.packing varlen: document lengths are drawn uniformly from [doc_len_min, doc_len_max] tokens
    doc_len_min: int = 8
    doc_len_max: int = 96

    def validate(self, key: str) -> None:
        _require(self.task in SYNTHETIC_TASKS, f"{key}.task", f"must be one of {SYNTHETIC_TASKS}", self.task)
        _require(self.vocab_size >= 2, f"{key}.vocab_size", "must be >= 2", self.vocab_size)
        _require(self.n_values >= 2, f"{key}.n_values", "must be >= 2", self.n_values)
        _require(self.doc_len_min >= 1, f"{key}.doc_len_min", "must be >= 1", self.doc_len_min)
        _require(self.doc_len_max >= self.doc_len_min, f"{key}.doc_len_max", "must be >= doc_len_min",
                 self.doc_len_max)
        if self.task == "needle_recall":
            _require(self.vocab_size >= self.n_values + 3, f"{key}.vocab_size",
                     "needle_recall needs vocab_size >= n_values + 3 (values, filler, BOS, QUERY)", self.vocab_size)


@dataclass(frozen=True)
class FinewebConfig:
    """FineWeb-Edu streaming through the `datasets` library (needs network)."""

    name: str = "HuggingFaceFW/fineweb-edu"
    subset: str = "sample-10BT"
    split: str = "train"
    shuffle_buffer: int = 10000
    max_retries: int = 5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0

    def validate(self, key: str) -> None:
        _require(self.shuffle_buffer >= 1, f"{key}.shuffle_buffer", "must be >= 1", self.shuffle_buffer)
        _require(self.max_retries >= 0, f"{key}.max_retries", "must be >= 0", self.max_retries)
        _require(self.backoff_initial_s > 0, f"{key}.backoff_initial_s", "must be > 0", self.backoff_initial_s)
        _require(self.backoff_max_s >= self.backoff_initial_s, f"{key}.backoff_max_s",
                 "must be >= backoff_initial_s", self.backoff_max_s)


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "jsonl", "text", "fineweb"] = "synthetic"
    # contiguous: windows of one token stream (documents joined by EOS; attention crosses documents).
    # varlen: each micro-batch is ONE packed row of micro_batch_size * seq_len tokens holding whole documents
    # with their boundaries (cu_seqlens, reference/packing.py): attention, positions and labels stay inside a
    # document, and the last token of each document has the ignore label (sentinels/data/packing.py).
    packing: Literal["contiguous", "varlen"] = "contiguous"
    paths: list[str] = field(default_factory=list)  # jsonl/text files ({"text": ...} per line / one doc per line)
    tokenizer: Literal["byte", "gpt2"] = "byte"
    shuffle_seed: int = 0
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    fineweb: FinewebConfig = field(default_factory=FinewebConfig)

    def validate(self, key: str) -> None:
        _require(self.source in DATA_SOURCES, f"{key}.source", f"must be one of {DATA_SOURCES}", self.source)
        _require(self.tokenizer in TOKENIZERS, f"{key}.tokenizer", f"must be one of {TOKENIZERS}", self.tokenizer)
        _require(self.packing in PACKINGS, f"{key}.packing", f"must be one of {PACKINGS}", self.packing)
        if self.packing == "varlen" and self.source == "synthetic":
            _require(self.synthetic.task == "uniform", f"{key}.synthetic.task",
                     "data.packing varlen packs synthetic documents of the 'uniform' task only", self.synthetic.task)
        if self.source in ("jsonl", "text"):
            _require(len(self.paths) > 0, f"{key}.paths", f"must list at least one file for source {self.source!r}",
                     self.paths)
        self.synthetic.validate(f"{key}.synthetic")
        self.fineweb.validate(f"{key}.fineweb")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 3e-3
    min_lr: float = 3e-4  # cosine floor
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: Literal["bf16", "fp32"] = "fp32"  # bf16 autocast on CUDA; CPU always runs fp32
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How ranks under torchrun share the work (sentinels/distributed.py; one process uses it only for the
    # checkpoint format). ddp: every rank holds the whole model, gradients are all-reduced, rank 0 writes one
    # checkpoint file. fsdp: FSDP2 (fully_shard) shards parameters, gradients and AdamW state over the ranks
    # (bf16 parameters in compute, fp32 gradient reduction on CUDA with precision bf16); sharded checkpoints
    # through torch.distributed.checkpoint.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    seed: int = 0
    # What backward recomputes instead of keeping: false keeps every activation; attention keeps each block's input
    # to its attention sublayer (and, on the kernel path, NSA's selection and selected-branch output) and recomputes
    # the rest of the sublayer (norm, q/k/v and gate projections, NSA, output projection) in backward, the MLP keeping
    # its activations as usual; true recomputes whole blocks.
    activation_checkpointing: Literal[False, True, "attention"] = False
    # Record each micro-step's forward and backward once as CUDA graphs and replay them (sentinels/graphs.py): one
    # launch instead of one per kernel, so the step time no longer depends on the host queueing many short NSA
    # kernels. true needs CUDA, one process, data.packing contiguous and activation_checkpointing false or attention
    # (refused otherwise); auto (the default) turns it on exactly when those hold; false keeps the eager step.
    cuda_graphs: Literal["auto", True, False] = "auto"
    save_every: int = 50  # steps between checkpoints (0 = only at the end / on halt)
    keep_checkpoints: int = 2
    out_dir: str = "runs/default"
    log_every: int = 10  # console progress lines when stderr is not a terminal

    def validate(self, key: str) -> None:
        for name in ("steps", "seq_len", "micro_batch_size", "grad_accum", "keep_checkpoints", "log_every"):
            _require(getattr(self, name) >= 1, f"{key}.{name}", "must be >= 1", getattr(self, name))
        _require(self.lr > 0, f"{key}.lr", "must be > 0", self.lr)
        _require(0 <= self.min_lr <= self.lr, f"{key}.min_lr", "must be in [0, lr]", self.min_lr)
        _require(0 <= self.warmup_steps <= self.steps, f"{key}.warmup_steps", "must be in [0, steps]",
                 self.warmup_steps)
        _require(self.weight_decay >= 0, f"{key}.weight_decay", "must be >= 0", self.weight_decay)
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1, f"{key}.{name}", "must be in [0, 1)", getattr(self, name))
        _require(self.grad_clip > 0, f"{key}.grad_clip", "must be > 0", self.grad_clip)
        _require(self.precision in PRECISIONS, f"{key}.precision", f"must be one of {PRECISIONS}", self.precision)
        _require(self.device in DEVICES, f"{key}.device", f"must be one of {DEVICES}", self.device)
        _require(self.parallel in PARALLELS, f"{key}.parallel", f"must be one of {PARALLELS}", self.parallel)
        _require(_one_of(self.activation_checkpointing, ACTIVATION_CHECKPOINTING), f"{key}.activation_checkpointing",
                 "must be one of [false, true, attention]", self.activation_checkpointing)
        _require(self.save_every >= 0, f"{key}.save_every", "must be >= 0", self.save_every)
        _require(bool(self.out_dir), f"{key}.out_dir", "must be a non-empty path", self.out_dir)


@dataclass(frozen=True)
class LossFloorConfig:
    threshold: float = thresholds.LOSS_FLOOR_NATS
    before_step: int = thresholds.LOSS_FLOOR_BEFORE_STEP
    dump_batches: int = thresholds.LOSS_FLOOR_DUMP_BATCHES

    def validate(self, key: str) -> None:
        _require(self.threshold >= 0, f"{key}.threshold", "must be >= 0", self.threshold)
        _require(self.before_step >= 0, f"{key}.before_step", "must be >= 0", self.before_step)
        _require(self.dump_batches >= 1, f"{key}.dump_batches", "must be >= 1", self.dump_batches)


@dataclass(frozen=True)
class GateCollapseConfig:
    high: float = thresholds.GATE_COLLAPSE_HIGH
    low: float = thresholds.GATE_COLLAPSE_LOW
    steps: int = thresholds.GATE_COLLAPSE_STEPS

    def validate(self, key: str) -> None:
        _require(0 <= self.low < self.high <= 1, f"{key}.low/high", "need 0 <= low < high <= 1",
                 (self.low, self.high))
        _require(self.steps >= 1, f"{key}.steps", "must be >= 1", self.steps)


@dataclass(frozen=True)
class WatchdogConfig:
    throughput_drop: float = thresholds.WATCHDOG_THROUGHPUT_DROP
    throughput_drop_steps: int = thresholds.WATCHDOG_THROUGHPUT_DROP_STEPS
    fetch_growth: float = thresholds.WATCHDOG_FETCH_GROWTH
    fetch_floor_s: float = thresholds.WATCHDOG_FETCH_FLOOR_S
    heartbeat_stall_s: float = thresholds.WATCHDOG_HEARTBEAT_STALL_S
    baseline_steps: int = thresholds.WATCHDOG_BASELINE_STEPS

    def validate(self, key: str) -> None:
        _require(0 < self.throughput_drop < 1, f"{key}.throughput_drop", "must be in (0, 1)", self.throughput_drop)
        _require(self.throughput_drop_steps >= 1, f"{key}.throughput_drop_steps", "must be >= 1",
                 self.throughput_drop_steps)
        _require(self.fetch_growth > 1, f"{key}.fetch_growth", "must be > 1", self.fetch_growth)
        _require(self.fetch_floor_s >= 0, f"{key}.fetch_floor_s", "must be >= 0", self.fetch_floor_s)
        _require(self.heartbeat_stall_s > 0, f"{key}.heartbeat_stall_s", "must be > 0", self.heartbeat_stall_s)
        _require(self.baseline_steps >= 1, f"{key}.baseline_steps", "must be >= 1", self.baseline_steps)


@dataclass(frozen=True)
class MonitorsConfig:
    halt_on_event: bool = False  # create .HALT when a gate-collapse or watchdog event fires
    loss_floor: LossFloorConfig = field(default_factory=LossFloorConfig)
    gate_collapse: GateCollapseConfig = field(default_factory=GateCollapseConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def validate(self, key: str) -> None:
        self.loss_floor.validate(f"{key}.loss_floor")
        self.gate_collapse.validate(f"{key}.gate_collapse")
        self.watchdog.validate(f"{key}.watchdog")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)

    def __post_init__(self) -> None:
        self.model.validate("model")
        self.data.validate("data")
        self.train.validate("train")
        self.monitors.validate("monitors")
        if self.train.cuda_graphs is True:
            _require(self.train.device != "cpu", "train.cuda_graphs", "needs train.device cuda or auto",
                     self.train.device)
            _require(self.data.packing == "contiguous", "train.cuda_graphs",
                     "replays one batch shape: needs data.packing contiguous (varlen batches change shape)",
                     self.data.packing)
            _require(self.train.activation_checkpointing is not True, "train.cuda_graphs",
                     "is not combined with train.activation_checkpointing true (whole blocks; attention is)",
                     self.train.activation_checkpointing)
        if self.model.debug.leak == "cross_document":
            _require(self.data.packing == "varlen", "model.debug.leak",
                     "cross_document drops the document boundaries of data.packing varlen (set data.packing: varlen)",
                     self.model.debug.leak)

    # ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field (sorted keys): the identity of this config."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def replace(self, **dotted: Any) -> "RunConfig":
        """A validated copy with dotted keys overridden, e.g. replace(**{"train.steps": 10})."""
        data = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(data, key, value)
        return from_dict(data)

    def vocab_size(self) -> int:
        """Size of the token id space the model must embed."""
        from .data.tokenizers import tokenizer_vocab_size

        if self.data.source == "synthetic":
            return self.data.synthetic.vocab_size
        return tokenizer_vocab_size(self.data.tokenizer)

    def summary(self) -> dict[str, Any]:
        """The fields a launch preflight validates, resolved."""
        from .model import count_parameters_for

        nsa = self.model.nsa_config()
        return {
            "name": self.name,
            "config_hash": self.config_hash(),
            "precision": self.train.precision,
            "device": self.train.device,
            "steps": self.train.steps,
            "save_every": self.train.save_every,
            "out_dir": self.train.out_dir,
            "seq_len": self.train.seq_len,
            "sel_block": nsa.sel_block,
            "tokens_per_step_per_rank": self.train.seq_len * self.train.micro_batch_size * self.train.grad_accum,
            # varlen: one packed row of micro_batch_size * seq_len tokens per micro-step (same token count)
            "tokenizer": self.data.tokenizer,
            "data_source": self.data.source,
            "packing": self.data.packing,
            "vocab_size": self.vocab_size(),
            "parameters": count_parameters_for(self),
            "attention": self.model.attention,
            "debug": dataclasses.asdict(self.model.debug),
        }


# --------------------------------------------------------------------------------------------------
# Strict dict -> dataclass conversion


def from_dict(values: dict[str, Any]) -> RunConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"a run config must be a mapping at the top level, got {type(values).__name__}")
    return _build(RunConfig, values, "")


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Parse a YAML run config; overrides are 'dotted.key=yaml-value' strings applied on top.

    Refused with the file and line: a file that is missing or unreadable, invalid YAML, a file with no settings
    (empty or comments only: it would start a default run), a key set twice in one mapping."""
    path = Path(path)
    values = _read_yaml_mapping(path)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_one_line(exc)})") from None
        _set_dotted(values, key.strip(), value)
    return from_dict(values)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _refuse_duplicate_keys(node, path, "")
        values = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"{mark.line + 1}" if mark is not None else "1"
        problem = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"{path}:{line}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}:1: not valid YAML: {_one_line(exc)}") from None
    finally:
        loader.dispose()
    if values is None:
        last = max(1, len(text.splitlines()))
        raise ConfigError(f"{path}:{last}: the config file holds no settings (empty, or comments only): refusing to "
                          f"start a run of default settings")
    if not isinstance(values, dict):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: a run config must hold a mapping of keys at the top "
                          f"level, got {type(values).__name__}")
    return values


def _refuse_duplicate_keys(node: yaml.Node, path: Path, prefix: str) -> None:
    """A key set twice in one mapping: YAML keeps the last value, so one setting would be silently ignored."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{prefix}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
        dotted = f"{prefix}.{key}" if prefix else str(key)
        line = key_node.start_mark.line + 1
        if key in first_line:
            raise ConfigError(f"{path}:{line}: duplicate key {dotted} (first set on line {first_line[key]}): YAML "
                              f"keeps only the last value, so one of them would be silently ignored")
        first_line[key] = line
        _refuse_duplicate_keys(value_node, path, dotted)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, values: Any, prefix: str) -> Any:
    where = prefix or "<top level>"
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(values).__name__} {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}.{k}" if prefix else k for k in unknown)
        raise ConfigError(f"unknown config key(s) {names}; allowed keys under {where}: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _yaml(value: Any) -> str:
    """A config value as YAML spells it (true / false for booleans)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if not _one_of(value, allowed):
            raise ConfigError(f"{key}: must be one of [{', '.join(_yaml(a) for a in allowed)}], got {_yaml(value)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {type(value).__name__} {value!r}")
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: must be a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp!r}")  # pragma: no cover - a bug in this module
