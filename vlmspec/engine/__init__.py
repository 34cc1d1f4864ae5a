"""The speculative decoding loop over a batch of requests (of one too), on token ids (text: `vlmspec.text`).

    ticket = batch.submit(inputs, config)                   # queued (options: its GenerationConfig); a step admits it
    batch.step():  prefill: pieces of long prompts, then free slots admit waiting tickets under the
                   step's budget (vlmspec.engine.prefill; first token: the root); then decode:
        depth_b  = control_b.choose(max_depth_b)            # how deep each row drafts (vlmspec.policy.control)
        trees    = propose_all(drafter, sessions, roots, depths, chains)   # per-row trees (EAGLE: rows together)
        out      = target.forward_batch(states, trees)      # ONE target forward over every row's nodes
        verdicts = verify_rows(trees, out.logits, ...)      # each row: accepted path + recovered/bonus token
        target.commit_batch(states, paths); session_b.commit(...); emit; finished rows leave

The `none` drafter's trees are roots alone: plain decoding, every drafter's oracle. A step that fails for one row alone
takes that row out (`failure` set); an exception of the batched work is raised by `step` and leaves the batch unusable.
"""


from vlmspec.engine.batch import Batch, RowFailure, Ticket
from vlmspec.engine.spec import Generation, SpecEngine
from vlmspec.engine.types import TIMING_KEYS, Clock, GenerationConfig, GenerationResult, StepEvent

__all__ = ["SpecEngine", "Batch", "Ticket", "GenerationConfig", "GenerationResult", "RowFailure", "StepEvent", "Generation", "Clock",
           "TIMING_KEYS"]
