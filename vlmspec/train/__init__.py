"""Training and evaluation: `train-target` (SFT of the bundled VLM, `target_sft`), `train` (online
distillation of draft heads, `distill`), `eval-target` (`target_eval`); data in `data`."""
