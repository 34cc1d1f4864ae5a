"""Training drafters: `vlmspec train` (online distillation of draft heads, `distill`) through the one
training loop (`loop`), on `data`'s conversations and `magpie`'s text pairs. (The bundled targets'
own trainers are recipes: `recipes.train`.)"""
