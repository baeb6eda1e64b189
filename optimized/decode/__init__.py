"""NSA decoding with a per-branch KV cache (docs/decode.md): `NSADecodeCache` (prefill, step, extend; counted
reads per step), an addition to the contract's recompute-from-full-cache `optimized.decode_step`."""

from .cache import NSADecodeCache, window_capacity

__all__ = ["NSADecodeCache", "window_capacity"]
