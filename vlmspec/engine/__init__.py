"""The speculative decoding loop, on token ids, over a batch of requests (a batch of one included).

    ticket = batch.submit(inputs, config)                   # queued; admitted by a step
    batch.step():                                            # one round over every live request
        prefill: the next piece of each long prompt (one forward), then waiting tickets into free
        slots, FCFS, under the step's prefill budget        # (vlmspec.engine.prefill; first token: root)
        depth_b  = control_b.choose(max_depth_b)            # how deep each row drafts (vlmspec.control)
        trees    = propose_all(drafter, sessions, roots, depths, chains)   # per-row trees (EAGLE: rows together)
        out      = target.forward_batch(states, trees)      # ONE target forward over every row's nodes
        verdicts = verify_rows(trees, out.logits, ...)      # each row: accepted path + recovered/bonus token
        target.commit_batch(states, paths); session_b.commit(...)  # keep each row's accepted KV entries
        control_b.observe(...); emit each row's tokens      # rows that finished leave; their slot is free

With the `none` drafter every tree is the root alone and this is plain autoregressive decoding,
which is the oracle every other drafter is tested against. The engine knows token ids only:
detokenization, stop strings and hold-back live in `vlmspec.text`, wrapped around it. Everything
one request needs travels in its `GenerationConfig` and its `_Request` state, never on the engine;
`SpecEngine.generate` / `stream` run a `Batch` of one.

A step that fails for one row alone (its drafter session's propose or commit, its controller)
takes that row out with its `failure` set and steps the others as if it had not been there; an
exception of the batched work itself (a batched drafter, the target's forward, the verify) is
raised by `step` and leaves the batch unusable.
"""


from vlmspec.engine.batch import Batch, RowFailure, Ticket
from vlmspec.engine.spec import Generation, SpecEngine
from vlmspec.engine.types import TIMING_KEYS, Clock, GenerationConfig, GenerationResult, StepEvent

__all__ = ["SpecEngine", "Batch", "Ticket", "GenerationConfig", "GenerationResult", "RowFailure", "StepEvent", "Generation", "Clock",
           "TIMING_KEYS"]
