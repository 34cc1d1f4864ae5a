"""Online-logit distillation of draft heads. Not built yet: issue #4."""
