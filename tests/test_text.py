"""Tier 1: the text layer on its own (no model): incremental detokenization, stop strings, hold-back,
and the work per token staying flat as the output grows."""
import random
from types import SimpleNamespace

import pytest

from vlmspec.engine import GenerationResult, StepEvent
from vlmspec.stats import SpecStats
from testing.tiny import build_tokenizer
from vlmspec.text import IncrementalDetokenizer, StopStringFilter, decode, generate_text, stream_text


class ByteTokenizer:
    """Token i is one byte (i < 256); ids >= 256 are special (skipped). Counts the ids it decodes."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode("utf-8"))


class SpaceDroppingTokenizer(ByteTokenizer):
    """Like SentencePiece: a decode drops the leading space of its first token."""

    def decode(self, ids, skip_special_tokens=True):
        text = super().decode(ids)
        return text[1:] if text.startswith(" ") else text


class FakeEngine:
    """Streams fixed steps of token ids as the engine would."""

    def __init__(self, tokenizer, steps, finish="length"):
        self.target = SimpleNamespace(tokenizer=tokenizer)
        self.steps, self.finish, self.closed_after = steps, finish, None

    def stream(self, inputs, config):
        engine = self

        class Gen:
            result = None

            def __iter__(self):
                return self._it()

            def _it(self):
                emitted = []
                try:
                    for i, ids in enumerate(engine.steps):
                        emitted += ids
                        engine.closed_after = i + 1
                        yield StepEvent(list(ids), 0, 0)
                finally:
                    self.result = GenerationResult(emitted, engine.finish, 3, SpecStats(), 0.1, {})

            def close(self):
                pass

        gen = Gen()
        it = iter(gen)
        gen.__iter__ = lambda: it  # one iterator, as the engine's Generation has
        gen.close = it.close
        return gen


def _stream(tokenizer, ids, step=1, stop=()):
    steps = [ids[i : i + step] for i in range(0, len(ids), step)]
    gen = stream_text(FakeEngine(tokenizer, steps), {}, None, stop)
    pieces = [e.text for e in gen]
    return pieces, gen.completion


TEXTS = ["plain ascii text, nothing odd", "héllo wörld — ünïcode ✓ 😀 done", "日本語のテキスト 🎉🎉", " leading space and  two"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_text_equals_full_decode_multibyte_split(text, step):
    tok = ByteTokenizer()
    ids = tok.encode(text)  # every multi-byte character is split across tokens
    pieces, done = _stream(tok, ids, step)
    assert "".join(pieces) == done.text == text
    assert all("\ufffd" not in p for p in pieces), "half a character was streamed"


def test_offsets_cancel_a_dropped_leading_space():
    tok = SpaceDroppingTokenizer()
    ids = tok.encode("a b  c d")
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tok.decode(ids) == "a b  c d"


def test_trailing_incomplete_character_is_flushed_as_the_tokenizer_decodes_it():
    tok = ByteTokenizer()
    ids = tok.encode("ok é")[:-1]  # the last byte of é is missing
    pieces, done = _stream(tok, ids)
    assert done.text == tok.decode(ids) and done.text.endswith("\ufffd")
    assert "".join(pieces) == done.text


def test_special_tokens_are_skipped():
    tok = ByteTokenizer()
    ids = tok.encode("ab") + [300] + tok.encode("cd") + [301]
    pieces, done = _stream(tok, ids)
    assert done.text == "abcd" == "".join(pieces)


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_spanning_tokens_cuts_and_stops(step):
    tok = ByteTokenizer()
    text = "first line\n\nsecond line\n\nthird"
    engine = FakeEngine(tok, [tok.encode(text)[i : i + step] for i in range(0, len(text), step)])
    gen = stream_text(engine, {}, None, stop=("\n\n",))
    streamed = "".join(e.text for e in gen)
    assert streamed == gen.completion.text == "first line"
    assert gen.completion.finish_reason == "stop"
    assert engine.closed_after < len(engine.steps), "the engine was not stopped at the stop string"


def test_hold_back_never_streams_a_stop_prefix():
    tok = ByteTokenizer()
    gen = stream_text(FakeEngine(tok, [[b] for b in tok.encode("abc<EN")] + [[b] for b in tok.encode("D>rest")]), {}, None, stop=("<END>",))
    pieces = [e.text for e in gen]
    sent = ""
    for p in pieces:
        sent += p
        assert "<" not in sent, f"streamed the start of a possible stop string: {sent!r}"
    assert gen.completion.text == "abc" and gen.completion.finish_reason == "stop"


def test_held_back_text_is_released_when_no_stop_follows():
    f = StopStringFilter(("STOP",))
    out = f.push("abcST") + f.push("xyz") + f.push("", final=True)
    assert out == "abcSTxyz" and not f.stopped


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(("cd", "b"))
    assert f.push("abcd", final=False) == "a" and f.stopped and f.text == "a"


def test_finish_reason_passes_through_without_stop():
    tok = ByteTokenizer()
    gen = stream_text(FakeEngine(tok, [tok.encode("hi")], finish="stop"), {}, None)
    list(gen)
    assert gen.completion.finish_reason == "stop" and gen.completion.text == "hi"
    done = generate_text(FakeEngine(tok, [tok.encode("hi")]), {}, None)
    assert done.finish_reason == "length" and done.to_dict()["text"] == "hi"


def test_decode_work_per_token_does_not_grow_with_output_length():
    """Re-decoding the whole output each step would make 512 tokens cost 64x more per token than 64."""
    per_token = {}
    for n in (64, 512):
        tok = ByteTokenizer()
        ids = tok.encode(("speculative decoding é " * 40)[:n])
        _stream(tok, ids, step=3)
        per_token[n] = tok.decoded / n
    assert per_token[512] <= 1.2 * per_token[64], per_token


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_real_byte_level_tokenizer_random_ids(arch):
    """On a trained byte-level BPE tokenizer, random id sequences (split characters included)
    stream to exactly the tokenizer's own decode of all ids."""
    tok = build_tokenizer(arch)
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == decode(tok, ids), ids
