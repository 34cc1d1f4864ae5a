"""The target's KV memory: `kv_cache` (the per-layer key/value tensors a forward reads and writes)
and `slot_cache` (one preallocated cache of `max_batch` slots, a request a slot, fixed at start-up)."""
