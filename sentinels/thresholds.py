"""Every sentinel and monitor threshold, in one place (docs/sentinels.md explains each).

Monitors (used by every training run, overridable per run config under `monitors:`):
"""

# Loss floor: on real text a loss this low this early means the model sees its labels.
LOSS_FLOOR_NATS = 0.02  # a step loss below this ...
LOSS_FLOOR_BEFORE_STEP = 1000  # ... before this step halts the run and dumps the last batches
LOSS_FLOOR_DUMP_BATCHES = 4  # how many of the last batches are dumped

# Gate collapse: a branch's mean gate (Eq. 5 g^c, one layer) pinned near 0 or 1.
GATE_COLLAPSE_HIGH = 0.98
GATE_COLLAPSE_LOW = 0.02
GATE_COLLAPSE_STEPS = 100  # an event after more than this many consecutive steps outside [low, high]

# Watchdog.
WATCHDOG_THROUGHPUT_DROP = 0.40  # tokens/s below (1 - 0.40) x the baseline median ...
WATCHDOG_THROUGHPUT_DROP_STEPS = 5  # ... for this many consecutive steps
WATCHDOG_FETCH_GROWTH = 2.0  # median dt_fetch of the last drop_steps steps > 2x the baseline median ...
WATCHDOG_FETCH_FLOOR_S = 0.002  # ... and above this absolute floor (sub-ms fetch jitter is not a stall)
WATCHDOG_HEARTBEAT_STALL_S = 300.0  # no completed step for this long
WATCHDOG_BASELINE_STEPS = 10  # steps (after the first two, which include warm-up) forming the baselines

# Sentinel verdicts (the suite in sentinels/suite.py):
RANDOM_LABEL_MARGIN_NATS = 0.10  # |eval loss - ln V| must be <= this; a leak drives the loss far below ln V
LONG_RANGE_FULL_MAX_ANSWER_LOSS = 0.50  # full NSA must reach this answer loss (nats) on needle recall
LONG_RANGE_LOCAL_MARGIN_NATS = 0.25  # locals-only answer loss must stay >= ln(n_values) - this

# Document isolation (data.packing varlen): the run model, untrained, on one packed row of documents.
DOC_ISOLATION_PERTURB_MAX = 1e-5  # max |logit change| in the OTHER documents when one document's tokens change,
#                                   relative to the largest |logit|: a leak-free model changes them not at all
DOC_ISOLATION_ALONE_MAX = 1e-3  # max |packed logits - the document run alone| relative to the largest |logit|
#                                 (shapes differ, so fp32 reductions may round differently; TF32 is off for it)

# Causal isolation (sentinels/isolation.py): the run model, untrained and trained, nothing at t moves a logit at p < t.
CAUSAL_ISOLATION_CUDA_NOISE_FACTOR = 4.0  # CUDA bound = this x the largest control-row difference (0 -> bitwise);
#                                            CPU (fp32, TF32 off) is always bitwise
