"""Magpie pairs (vlmspec.train.magpie): the filtering on a scripted model (no network, no weights)."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from vlmspec import assets
from vlmspec.data.heldout import TEXT_PROMPTS
from vlmspec.train.magpie import MagpieConfig, cached_pairs, magpie_pairs, user_turn_opening


class ScriptedModel:
    """`generate` answers from scripts: sampled calls (the user turns) pop the next batch of
    instructions; greedy calls answer each prompt by a rule. A script entry ending in None never
    ends its turn (cut by max_new_tokens)."""

    def __init__(self, tok, instructions: list[list[str | None]]):
        self.tok, self.instructions, self.calls = tok, list(instructions), []

    def _ids(self, text: str | None, ended: bool, width: int) -> list[int]:
        ids = self.tok(text or "and so on and on", add_special_tokens=False)["input_ids"][: width - 1]
        return ids + [self.tok.eos_token_id] if ended else ids

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, do_sample, **kw):
        self.calls.append(do_sample)
        texts = self.tok.batch_decode(input_ids, skip_special_tokens=True)
        if do_sample:
            script = self.instructions.pop(0)
            rows = [self._ids(script[i % len(script)], script[i % len(script)] is not None, max_new_tokens) for i in range(len(texts))]
        else:
            rows = [self._ids("no", False, max_new_tokens) if "forever" in t else self._ids("Sure: " + t.split()[-1], True, max_new_tokens) for t in texts]
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def _tok():
    return AutoTokenizer.from_pretrained(assets.BUNDLED_TARGET)


def test_user_turn_opening_is_the_template_up_to_the_users_text():
    tok = _tok()
    opening = user_turn_opening(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert full.startswith(opening) and full[len(opening):].startswith("hello there")


def test_pairs_keep_complete_new_instructions_with_complete_answers(tmp_path):
    tok = _tok()
    batch1 = ["name three red fruits", TEXT_PROMPTS[0], "hi", None, "Name three  RED fruits", "talk about it forever"]
    batch2 = ["list two blue birds"]
    model = ScriptedModel(tok, [batch1, batch2])
    cfg = MagpieConfig(n=3, batch=6, prompt_tokens=24, answer_tokens=12, max_rounds=3)
    pairs = magpie_pairs(model, tok, cfg, progress=False)
    # kept: new instructions of >= 3 words that ended, with their answers, cut or not; dropped: a
    # held-out prompt, a short one, an unfinished one, a repeat up to case and spacing
    assert [p for p, _, _ in pairs] == ["name three red fruits", "talk about it forever", "list two blue birds"]
    assert pairs[0][1:] == ("Sure: fruits", True) and pairs[1][2] is False  # the answer that never ends is marked cut
    assert model.calls == [True, False, True, False]  # stopped once n pairs were in
    # cached: the same pairs come back without generating; another config regenerates
    path = tmp_path / "magpie.json"
    assert cached_pairs(path, ScriptedModel(tok, [batch1, batch2]), tok, cfg, progress=False) == pairs
    assert cached_pairs(path, ScriptedModel(tok, []), tok, cfg, progress=False) == pairs
    other = ScriptedModel(tok, [["what is a good name for a cat"]] * 3)
    assert [p for p, _, _ in cached_pairs(path, other, tok, MagpieConfig(n=1, batch=1, max_rounds=3), progress=False)] == ["what is a good name for a cat"]


def test_openers_start_the_sampled_user_turns_and_cycle_over_the_slots():
    tok = _tok()

    class Recording(ScriptedModel):
        def generate(self, input_ids, **kw):
            if kw["do_sample"]:
                self.sampled = self.tok.batch_decode(input_ids, skip_special_tokens=False)
            return super().generate(input_ids, **kw)

    model = Recording(tok, [[" a poem about rain", " the planets by size", " does ice float", " a name for a cat"]])
    cfg = MagpieConfig(n=4, batch=4, prompt_tokens=24, answer_tokens=12, max_rounds=1, openers=("Write", "List", "Why"))
    pairs = magpie_pairs(model, tok, cfg, progress=False)
    opening = user_turn_opening(tok)
    assert [t[t.index(opening) + len(opening):] for t in model.sampled] == ["Write", "List", "Why", "Write"]  # slot i: opener i mod 3
    assert [p for p, _, _ in pairs] == ["Write a poem about rain", "List the planets by size", "Why does ice float", "Write a name for a cat"]
    # without openers the turn is left open (Magpie), as before
    plain = Recording(tok, [["name three red fruits"]])
    magpie_pairs(plain, tok, MagpieConfig(n=1, batch=1, prompt_tokens=24, answer_tokens=12, max_rounds=1), progress=False)
    assert plain.sampled[0].endswith(opening)
