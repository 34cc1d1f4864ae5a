"""How the bundled models' trained parts were made, and the one-off research suites: the lab, apart
from the product. Not in the wheel: run from a checkout as `python -m recipes COMMAND`.

Nothing under `vlmspec/` or `app/` imports this package (tests/test_layers.py checks it); a recipe
may use anything of the product.
"""
