"""Bug shared by decode and prefill: the window branch attends to the current key only (a window length of 1
reaching both code paths, e.g. through one mis-set config field), so decode_step equals nsa_forward exactly and
decode = prefill cannot see it.

Adapter: nsa_forward and decode_step = optimized's with the window w = 1 (reads as counted for w = 1).
Caught by: Counted reads and decode = prefill, decode compared with the reference oracle.
"""

import optimized

from conformance.selftest.variants import optimized_variant


def nsa_forward_one_key(q, kv, gates, cfg, phi=None, **kwargs):
    return optimized.nsa_forward(q, kv, gates, cfg.replace(window=1), phi, **kwargs)


def decode_step_one_key(q, kv, gates, cfg, phi=None, **kwargs):
    return optimized.decode_step(q, kv, gates, cfg.replace(window=1), phi, **kwargs)


IMPL = optimized_variant("decode_shared_one_key", nsa_forward=nsa_forward_one_key, decode_step=decode_step_one_key,
                         NSADecodeCache=None)
