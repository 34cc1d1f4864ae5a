"""`vlmspec.LLM`, the Python facade: on a tiny in-process LLaVA, a batch of requests through it gives
each request's answer alone through the engine (token for token, text, counters); the three ways
to pass an image (OpenAI's data URL part, HF's part, a bare part with images=) and a file path give
the same prompt; a stop string ends its row early; bad input is refused saying what to give. On the
committed toy, `LLM(model="toy")` answers with its EAGLE drafter exactly as plain decoding does."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import pytest

from conftest import tiny_target
from vlmspec import LLM, Output, assets
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import ConfigError, InputError
from vlmspec.inputs import encode_prompt
from testing.tiny import tiny_image
from vlmspec.text import generate_text

NEW = 24


@pytest.fixture(scope="module")
def engine():
    target = tiny_target("llava")
    return SpecEngine(target, NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_batch_gives_each_request_its_answer_alone(engine, tmp_path):
    llm = LLM.from_engine(engine, max_batch=2)  # 3 requests through 2 slots: one joins when a row leaves
    path = tmp_path / "img.png"
    tiny_image(2).save(path)
    requests = ["once upon a time, in a quiet village",
                {"prompt": "describe the image in detail", "images": [tiny_image(0)]},
                {"prompt": "compare the first image with the second image", "images": [str(path), tiny_image(1)], "max_new_tokens": 9}]
    outs = llm.generate(requests, max_new_tokens=NEW)
    assert isinstance(outs, list) and len(outs) == 3 and all(isinstance(o, Output) for o in outs)
    alone = [(requests[0], []), (requests[1]["prompt"], [tiny_image(0)]), (requests[2]["prompt"], [tiny_image(2), tiny_image(1)])]
    for out, (prompt, images), new in zip(outs, alone, (NEW, NEW, 9)):
        ref = generate_text(engine, encode_prompt(engine.target, prompt, images), GenerationConfig(max_new_tokens=new))
        assert out.token_ids == ref.result.token_ids and out.text == ref.text and out.finish_reason == ref.finish_reason
        assert (out.drafted, out.accepted, out.tau) == (ref.result.num_drafted, ref.result.num_accepted, ref.result.mean_accepted_length)
        assert out.prompt_tokens == ref.result.prompt_tokens and len(out.token_ids) <= new
    assert any(o.drafted > 0 for o in outs)  # the n-gram drafter proposed something: the counters are not all zero
    one = llm.generate(requests[0], max_new_tokens=NEW)  # one request in, one Output out
    assert isinstance(one, Output) and one.token_ids == outs[0].token_ids


def test_every_way_to_pass_an_image_gives_the_same_prompt(engine, tmp_path):
    llm = LLM.from_engine(engine)
    image = tiny_image(3)
    path = tmp_path / "img.png"
    image.save(path)
    text = {"type": "text", "text": "describe the image in detail"}
    ways = {
        "openai data url": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}, text]}], None),
        "hf pil": ([{"role": "user", "content": [{"type": "image", "image": image}, text]}], None),
        "hf path": ([{"role": "user", "content": [{"type": "image", "path": str(path)}, text]}], None),
        "bare + images=": ([{"role": "user", "content": [{"type": "image"}, text]}], [image]),
    }
    ref = encode_prompt(engine.target, text["text"], [image])["input_ids"].tolist()
    for way, (messages, images) in ways.items():
        assert llm.encode(llm_request(messages, images))["input_ids"].tolist() == ref, way
    outs = llm.chat([m for m, _ in list(ways.values())[:3]], max_new_tokens=8)  # a list of conversations: a list of answers
    assert len(outs) == 3 and outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def llm_request(messages, images):
    from vlmspec.llm import Request

    return Request(messages=messages, images=list(images or []))


def test_a_stop_string_ends_its_row_early(engine):
    llm = LLM.from_engine(engine, max_batch=2)
    prompt = "once upon a time, in a quiet village"
    full = llm.generate(prompt, max_new_tokens=NEW)
    cut = full.text.strip()[len(full.text.strip()) // 2:][:3]  # a piece from the middle of the answer
    assert cut and cut in full.text
    outs = llm.generate([prompt, {"prompt": prompt, "stop": ()}], stop=(cut,), max_new_tokens=NEW)
    assert outs[0].finish_reason == "stop" and outs[0].text == full.text[: full.text.index(cut)]
    assert len(outs[0].token_ids) < len(full.token_ids)  # it left the batch at the stop string
    assert outs[1].text == full.text and outs[1].token_ids == full.token_ids  # its own stop=(): not cut (the control)


def test_bad_input_says_what_to_give(engine):
    llm = LLM.from_engine(engine)
    with pytest.raises(InputError, match=r"1 image part\(s\) without an image and images= gives 0"):
        llm.chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    with pytest.raises(InputError, match="image not found"):
        llm.generate({"prompt": "hi", "images": ["no/such/file.png"]})
    with pytest.raises(InputError, match="a conversation goes to llm.chat"):
        llm.generate({"role": "user", "content": "hi"})
    with pytest.raises(InputError, match="either a prompt or messages"):
        llm.generate({"images": []})
    with pytest.raises(ConfigError, match="no option max_tokens"):
        LLM(model="toy", max_tokens=3)


def test_a_model_that_decodes_one_at_a_time_still_answers_a_list(engine, monkeypatch):
    """Target.check_batching refuses a batch: the requests run through a batch of one, in order."""
    plain = SpecEngine(engine.target, PlainDrafter())
    llm = LLM.from_engine(plain, max_batch=4)
    want = [llm.generate(p, max_new_tokens=6).token_ids for p in ("a b c", "d e f")]

    def refuse():
        raise ConfigError("one at a time")

    monkeypatch.setattr(plain.target, "check_batching", refuse)
    assert [o.token_ids for o in llm.generate(["a b c", "d e f"], max_new_tokens=6)] == want


def test_import_vlmspec_stays_light():
    """`LLM` is imported on first use: `import vlmspec.errors` loads neither it nor torch."""
    code = "import sys, vlmspec.errors; sys.exit(3 if 'vlmspec.llm' in sys.modules or 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
    code = "import sys; from vlmspec import LLM; sys.exit(0 if 'vlmspec.llm' in sys.modules else 3)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0  # the control: it is imported when asked for


@pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")
def test_the_toy_answers_with_its_drafter_as_plain_decoding_does():
    llm = LLM(model="toy", device="cpu", dtype="float32", policy="fixed", max_batch=2)
    assert llm.engine.drafter.name == "eagle"
    messages = [{"role": "user", "content": [{"type": "image", "image": str(assets.SAMPLE_IMAGES / "toyworld_scene.png")},
                                             {"type": "text", "text": "How many objects are there?"}]}]
    out = llm.chat(messages, max_new_tokens=32)
    plain = LLM.from_engine(SpecEngine(llm.engine.target, PlainDrafter())).chat(messages, max_new_tokens=32)
    assert out.text and out.token_ids == plain.token_ids and out.text == plain.text
    assert out.tau > 1.0 and out.accepted > 0 and plain.tau == 1.0 and plain.drafted == 0
