"""How deep to draft: the goodput policies (`control`: one request; `batch_control`: every row of a
batch's step together) and the step costs they price drafts with (`cost`: measured once per model,
drafter, dtype and machine, cached)."""
