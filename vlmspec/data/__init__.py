"""The data the drafters are trained and measured on: held-out sets, prompts, photographs, the corpus.

ToyWorld scenes come from the ToyWorld generator, its own distribution (folder toyworld/ of the
source tree, `pip install -e ./toyworld`; `make setup` installs it), not part of the vlmspec wheel:
:func:`toyworld` imports it or says how to install it.
"""

from __future__ import annotations

from types import ModuleType

from vlmspec.errors import ConfigError

# the generator's answer styles (toyworld.ANSWER_STYLES' keys; a test keeps them equal), named here so
# that options and configs are checked without the generator
ANSWER_STYLES = ("short", "listed", "scan", "tally")


def toyworld() -> ModuleType:
    """The ToyWorld generator module, or a ConfigError that says how to install it."""
    try:
        import toyworld as generator
    except ModuleNotFoundError as e:
        if e.name != "toyworld":
            raise
        raise ConfigError("ToyWorld scenes need the ToyWorld generator, which the vlmspec wheel does not hold: from a "
                          "source checkout run `pip install -e ./toyworld` (make setup does), or leave ToyWorld out "
                          "(benches: --prompts text or a JSONL; train: --data a corpus folder; data: --toyworld 0)") from None
    return generator
