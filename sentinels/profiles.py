"""Sentinel profiles: how big and how long each sentinel's runs are on CPU and on GPU.

A profile has two models:
  * the probe model (profile.probe_config) trains the learned sentinels (random-label, long-range, the planted
    leaks): small, so that a few hundred steps separate a leak from a clean model;
  * the run model (the --config under test, default profile.run_config) trains on real text for the loss
    floor, gate collapse and watchdog sentinels (twice: contiguous windows, then packed documents with
    data.packing varlen, both with profile.real_text) and is the model of doc_isolation: the configuration that
    is about to be launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


# Every sentinel's name, in the order they run (what `python -m sentinels run --only` accepts).
SENTINELS = ("causal_isolation", "label_shift", "doc_isolation", "random_label", "causal_isolation_trained",
             "long_range", "loss_floor", "gate_collapse", "watchdog", "loss_floor_varlen", "gate_collapse_varlen",
             "watchdog_varlen")

# The causal leaks each profile plants for the self-test (sentinels/plants.py): every one must trip
# causal_isolation; the random-label rows show the learned sentinel sees a leak at every position and a leak at one
# position in d through the compressed branch (which the trained isolation check catches too).
ISOLATION_PLANTS = ("kv_next_token", "cmp_block_early", "cmp_one_early", "cmp_visible_early",
                    "cmp_visible_early_last_layer", "window_next_key", "win_next_token_last_layer",
                    "win_next_token_one_head", "slc_values_next_token", "sel_block_unclipped", "sel_next_block",
                    "sel_block_end_kv", "sel_score_all_blocks", "sel_scores_next_block")
RANDOM_LABEL_PLANTS = ("kv_next_token", "cmp_one_early")


@dataclass(frozen=True)
class Profile:
    name: str
    probe_config: Path  # YAML whose model section is the probe model
    run_config: Path  # default --config for the real-text run
    device: str  # cpu | cuda
    precision: str  # fp32 | bf16
    random_label: dict = field(default_factory=dict)  # dotted overrides of the probe config
    random_label_eval_every: int = 25  # held-out evaluation every this many steps (a planted run stops at a trip)
    long_range: dict = field(default_factory=dict)
    real_text: dict = field(default_factory=dict)  # dotted overrides of the run config
    real_text_varlen: dict = field(default_factory=dict)  # the same for the packed run
    real_text_first_steps: dict = field(default_factory=dict)  # {"contiguous": N, "varlen": M}: the real-text run
    #   keeps the run config's own train.steps and learning-rate schedule (warmup included) and stops after its
    #   first N steps, as the launch would run them; a packing not named runs the override's train.steps
    real_text_min_steps: int = 0  # the contiguous real-text run must reach this step (else overall INCOMPLETE)
    real_text_cap_s: float | None = None  # wall-clock cap of that run (None: run_cap_s)
    plant_run: dict = field(default_factory=dict)  # overrides of the probe config for the gate/NaN/slow-data plants
    gate_collapse_plant_steps: int = 0  # steps of the planted saturated-gate run (> gate_collapse.steps)
    watchdog_plant_steps: int = 30
    label_shift_batches: int = 8
    eval_batches: int = 8
    isolation_rows: int = 16  # rows per forward of the causal-isolation check (unchanged, probes, control)
    isolation_random_positions: int = 16  # random positions t besides the block edges (rows longer than 256)
    isolation_plants: tuple[str, ...] = ISOLATION_PLANTS
    random_label_plants: tuple[str, ...] = RANDOM_LABEL_PLANTS
    trained_isolation_plants: tuple[str, ...] = ("cmp_one_early",)
    loss_floor_plant: dict = field(default_factory=dict)  # overrides of the probe config for the planted
    #   kv_next_token leak on real text ({} = not run). A window's last label is never visible, so the leaky loss
    #   stays near ln(V)/seq_len: the plant needs a long seq_len (docs/sentinels.md)
    budget_s: float = 300.0  # wall-clock budget of the whole profile (runs stop when it is spent)
    run_cap_s: float = 120.0  # wall-clock cap of one training run (it stops, and its verdict says so)
    cpu_threads: int | None = None  # torch intra-op threads (tiny CPU models run faster on one thread, and
    #                                 much faster than two on a shared 2-core machine)


PROFILES = {
    "cpu": Profile(
        name="cpu",
        probe_config=CONFIG_DIR / "tiny-cpu.yaml",
        run_config=CONFIG_DIR / "tiny-cpu.yaml",
        device="cpu",
        precision="fp32",
        # T = 128 = 4 n*l' (16 selection blocks, 4 picked). The leak at one position in d (cmp_one_early) trips
        # after 100-125 steps (seeds 0-3, `python -m sentinels sensitivity --profile cpu`); 300 steps is 2.4x that
        random_label={"train.steps": 300, "train.micro_batch_size": 8, "train.seq_len": 128, "train.lr": 1e-2,
                      "train.warmup_steps": 10, "data.synthetic.vocab_size": 64},
        plant_run={"train.micro_batch_size": 8, "train.seq_len": 32, "train.lr": 3e-3, "train.warmup_steps": 10,
                   "data.synthetic.vocab_size": 64},
        long_range={"train.steps": 100, "train.micro_batch_size": 16, "train.seq_len": 64, "train.lr": 1e-2,
                    "train.warmup_steps": 10, "data.synthetic.vocab_size": 64, "data.synthetic.n_values": 8},
        real_text={"train.steps": 120, "train.micro_batch_size": 8, "train.seq_len": 64, "train.lr": 3e-3,
                   "train.warmup_steps": 10},
        gate_collapse_plant_steps=110,
        budget_s=290.0,
        cpu_threads=1,
    ),
    "gpu": Profile(
        name="gpu",
        probe_config=CONFIG_DIR / "gpu-smoke.yaml",
        run_config=CONFIG_DIR / "prod-125m.yaml",
        device="cuda",
        precision="bf16",
        # T = 512 = 4 n*l' for gpu-smoke.yaml. 600 steps is a provisional default: confirm it with
        # `python -m sentinels sensitivity --profile gpu` (a leak at 1 position in d = 8 must trip well before)
        random_label={"train.steps": 600, "train.micro_batch_size": 16, "train.seq_len": 512, "train.lr": 2e-3,
                      "train.warmup_steps": 20, "data.synthetic.vocab_size": 64},
        random_label_eval_every=50,
        plant_run={"train.micro_batch_size": 16, "train.seq_len": 512, "train.lr": 2e-3, "train.warmup_steps": 20,
                   "data.synthetic.vocab_size": 64},
        # the full model learns the recall within ~30 steps on an H100 (answer loss 0.05 at step 20)
        long_range={"train.steps": 100, "train.micro_batch_size": 32, "train.seq_len": 512, "train.lr": 3e-3,
                    "train.warmup_steps": 20, "data.synthetic.vocab_size": 64, "data.synthetic.n_values": 8},
        # The first steps of the launch itself: the run config's model, seq_len, train.steps and learning-rate
        # schedule (its warmup included), one sequence per step, stopped after 600 (real_text_first_steps; a leak
        # that the model learns slowly collapsed a real run's loss after ~460 steps) inside the profile's 10
        # minutes. With steps: 600 and a 20-step warmup instead, the schedule is not the launch's (prod-125m's
        # gates of one layer fell below 0.02 within those 600 steps on an H100, gate_collapse).
        real_text={"train.micro_batch_size": 1, "train.grad_accum": 1},
        real_text_first_steps={"contiguous": 600, "varlen": 60},
        real_text_min_steps=600,
        real_text_cap_s=240.0,
        real_text_varlen={"train.micro_batch_size": 1, "train.grad_accum": 1},
        gate_collapse_plant_steps=110,
        watchdog_plant_steps=30,
        isolation_rows=8,
        # Byte tokens: with GPT-2 BPE (50257 ids) the leaky 15M probe needs far more than 300 steps to learn the
        # copy through the leaked key/value (measured on an H100: min loss 3.57 nats at step 300, falling ~0.5 nats
        # per 100 steps); over 256 byte ids it trips at step ~155. The monitor does not depend on the tokenizer;
        # the run stops at the trip (halt), so steps is a cap.
        loss_floor_plant={"train.steps": 400, "train.micro_batch_size": 4, "train.seq_len": 2048, "train.lr": 3e-3,
                          "train.warmup_steps": 10, "data.tokenizer": "byte"},
        budget_s=540.0,  # runs start only inside it: the whole profile stays under a 10-minute limit
        run_cap_s=55.0,
    ),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"--profile must be one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name]
