"""Tiny, randomly initialised, fully offline Hugging Face vision-language models for tests.

``build_tiny(arch)`` returns a real ``transformers`` model of the requested architecture
(float32, eval mode, SDPA attention) with a few-layer text decoder and a tiny vision tower,
plus a matching processor whose tokenizer is a small byte-level BPE trained in process.
Nothing is downloaded: everything is built from a seed.

Per-image placeholder token counts (48x48 RGB input, see ``tiny_image``):

* ``llava``       : 16 ``<image>`` tokens (32px crop, patch 8, CLS dropped by "default" strategy)
* ``llava_next``  : 24 ``<image>`` tokens (anyres: 2x2 grid of 32px crops + base crop, patch 16)
* ``qwen2_5_vl``  : 9 ``<|image_pad|>`` tokens (48x48 -> 6x6 patches of 8px, 2x2 merge)
* ``idefics3``    : 5 sub-images (2x2 split + global) x 4 ``<image>`` tokens, plus
  ``<fake_token_around_image>``/``<row_i_col_j>``/``<global-img>`` markers
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ARCHS = ("llava", "llava_next", "qwen2_5_vl", "idefics3")

# Text-decoder sizes shared by every architecture.
VOCAB_SIZE = 1001  # odd on purpose; >= len(tokenizer)
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128
LAYERS = 2
MAX_POS = 4096
BPE_VOCAB = 900  # byte alphabet (256) + BPE merges; the added special tokens go on top

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A picture of a cat sitting on a red sofa next to a window.",
    "Describe the image in detail. What colors and shapes do you see?",
    "There are two dogs playing with a ball in the green park.",
    "The sky is blue and the sun is shining over the mountains.",
    "A man is riding a bicycle down a busy city street at night.",
    "What is written on the sign? The sign says stop.",
    "The image shows a table with apples, oranges and bananas.",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "Compare the first image with the second image and list the differences.",
    "This is a photo of a small boat floating on a calm lake.",
    "How many people are in the picture? I can see three people.",
    "The answer is yes. The answer is no. Please explain your reasoning.",
    "A bird with yellow feathers is standing on the branch of a tree.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: ,.;:!?'\"()[]{}",
    "user assistant system describe image images text question answer",
    "Once upon a time, in a quiet village surrounded by forests, lived an old clockmaker.",
    "Every morning he walked to the market, bought fresh bread, cheese, and strawberries.",
    "The weather forecast predicts heavy rain tomorrow, followed by sunny afternoons.",
    "Scientists measured temperature, humidity, pressure and wind velocity at the station.",
    "Vision-language models combine an image encoder with a large autoregressive decoder.",
    "Please summarize the chart: revenue increased quickly during the fourth quarter.",
    "Children were laughing while building a sandcastle near the turquoise ocean waves.",
    "The kitchen contains a refrigerator, microwave, oven, sink, and wooden cupboards.",
    "Traffic lights turned green; pedestrians crossed the intersection carefully.",
    "Mathematics: seventeen plus twenty-five equals forty-two, multiplied by three.",
    "An elephant, a giraffe, a zebra and a lion gathered around the waterhole.",
    "She painted the fence white, planted tulips, and watered the vegetable garden.",
    "Engineers designed lightweight bridges using steel cables and reinforced concrete.",
    "Our galaxy contains billions of stars, planets, comets, asteroids and nebulae.",
    "Musicians played violins, cellos, trumpets, flutes, drums and a grand piano.",
    "Jupiter, Saturn, Uranus, Neptune, Mercury, Venus, Earth and Mars orbit the Sun.",
    "Keyboard, monitor, mouse, printer, laptop, phone, tablet, camera, headphones.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March",
    "April May June July August September October November December spring summer autumn winter",
    "Furthermore, verification guarantees the output distribution remains exactly unchanged.",
]


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
def _special_tokens(arch: str) -> dict:
    """Per-arch special tokens: named roles + the ordered list of every added special token."""
    if arch in ("llava", "llava_next"):
        named = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "image": "<image>"}
        extra = ["<|im_start|>", "<|im_end|>"]
    elif arch == "qwen2_5_vl":
        named = {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "image": "<|image_pad|>"}
        extra = [
            "<|im_start|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|video_pad|>",
        ]
    elif arch == "idefics3":
        named = {
            "bos": "<|begin_of_text|>",
            "eos": "<end_of_utterance>",
            "pad": "<|finetune_right_pad_id|>",
            "image": "<image>",
        }
        extra = ["<fake_token_around_image>", "<global-img>", "<|end_of_text|>"]
        extra += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    ordered = [t for t in (named["pad"], named["bos"], named["eos"]) if t is not None]
    ordered += [named["image"]] + extra
    return {"named": named, "extra": extra, "ordered": ordered}


def _chat_template(arch: str) -> str:
    if arch == "idefics3":
        image = "<image>"
        return (
            "{{ bos_token }}{% for message in messages %}"
            "{{ message['role'] | capitalize }}:"
            "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
            "{% else %}{% for item in message['content'] %}"
            "{% if item['type'] == 'image' %}"
            + image
            + "{% elif item['type'] == 'text' %}{{ ' ' + item['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}"
        )
    if arch == "qwen2_5_vl":
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        bos = ""
    else:
        image = "<image>\n"
        bos = "{{ bos_token }}"
    return (
        bos + "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}"
        + image.replace("\n", "{{ '\\n' }}")
        + "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def trained_bpe(vocab_size: int = BPE_VOCAB) -> Tokenizer:
    """A deterministic byte-level BPE trained on the built-in corpus, no special tokens yet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def build_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE trained on a tiny built-in corpus, with the arch's specials."""
    spec = _special_tokens(arch)
    tok = trained_bpe()
    # Special tokens are appended at the top of the vocabulary (like real checkpoints).
    tok.add_special_tokens(spec["ordered"])
    named = spec["named"]
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=named["bos"],
        eos_token=named["eos"],
        pad_token=named["pad"],
        unk_token=None,
        extra_special_tokens=[named["image"]] + spec["extra"],
        model_max_length=MAX_POS,
        padding_side="left",
        chat_template=_chat_template(arch),
    )
    assert len(hf_tok) <= VOCAB_SIZE, (len(hf_tok), VOCAB_SIZE)
    return hf_tok


# --------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------
def tiny_image(seed: int, size: int = 48, height: int | None = None) -> Image.Image:
    """Deterministic random RGB image of ``size`` x ``size`` (or ``size`` wide x ``height`` tall)."""
    rng = np.random.default_rng(seed)
    h = size if height is None else height
    arr = rng.integers(0, 256, size=(h, size, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert("RGB")


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
def _ids(tok: PreTrainedTokenizerFast) -> dict:
    return {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
    }


def _llama_text_config(tok: PreTrainedTokenizerFast) -> dict:
    ids = _ids(tok)
    return dict(
        model_type="llama",
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )


def _clip_vision_config(patch_size: int) -> dict:
    return dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=patch_size,
        projection_dim=32,
    )


def _build_llava(tok, next_: bool):
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaImageProcessor,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    patch = 16 if next_ else 8
    image_token_id = tok.convert_tokens_to_ids("<image>")
    common = dict(
        text_config=_llama_text_config(tok),
        vision_config=_clip_vision_config(patch),
        image_token_index=image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    ip_kwargs = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc_kwargs = dict(
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP CLS token
        image_token="<image>",
        chat_template=_chat_template("llava"),
    )
    if next_:
        pinpoints = [[32, 64], [64, 32], [64, 64]]
        config = LlavaNextConfig(image_grid_pinpoints=pinpoints, image_seq_length=4, **common)
        model_cls = LlavaNextForConditionalGeneration
        image_processor = LlavaNextImageProcessor(image_grid_pinpoints=pinpoints, **ip_kwargs)
        processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, **proc_kwargs)
    else:
        config = LlavaConfig(image_seq_length=16, **common)
        model_cls = LlavaForConditionalGeneration
        image_processor = LlavaImageProcessor(**ip_kwargs)
        processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, **proc_kwargs)
    return config, model_cls, processor


def _build_qwen2_5_vl(tok):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    ids = _ids(tok)
    head_dim = HIDDEN // HEADS  # 16 -> mrope_section must sum to head_dim // 2 = 8
    text_config = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        use_sliding_window=False,
        max_window_layers=LAYERS,
    )
    assert sum(text_config["rope_parameters"]["mrope_section"]) == head_dim // 2
    vision_config = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,
        window_size=32,  # -> 2x2 merged-token windows
        out_hidden_size=HIDDEN,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    # factor = patch * merge = 16 px per merged token: 48x48 -> 3x3 = 9 tokens; capped at 8x8 = 64 tokens.
    pix = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=128 * 128)
    image_processor = Qwen2VLImageProcessor(**pix)
    video_processor = Qwen2VLVideoProcessor(**pix)
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=_chat_template("qwen2_5_vl"),
    )
    return config, Qwen2_5_VLForConditionalGeneration, processor


def _build_idefics3(tok):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    scale_factor = 2
    image_size, patch = 32, 8
    image_seq_len = (image_size // patch) ** 2 // scale_factor**2  # 4
    config = Idefics3Config(
        text_config=_llama_text_config(tok),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=patch,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    # Images are resized to longest edge 64 then split into 32px tiles (+1 global 32px image):
    # a 48x48 image -> 2x2 tiles + global = 5 sub-images x 4 tokens.
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 2 * image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=True,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=image_seq_len,
        chat_template=_chat_template("idefics3"),
    )
    return config, Idefics3ForConditionalGeneration, processor


def build_tiny(arch: str, seed: int = 0):
    """Build ``(model, processor)`` for ``arch`` in :data:`ARCHS`, deterministically from ``seed``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    tok = build_tokenizer(arch)
    if arch in ("llava", "llava_next"):
        config, model_cls, processor = _build_llava(tok, next_=arch == "llava_next")
    elif arch == "qwen2_5_vl":
        config, model_cls, processor = _build_qwen2_5_vl(tok)
    else:
        config, model_cls, processor = _build_idefics3(tok)

    config._attn_implementation = "sdpa"
    config.dtype = torch.float32
    # Guarantees the engine relies on.
    text_cfg = config.get_text_config()
    assert text_cfg.vocab_size % 2 == 1 and text_cfg.vocab_size >= len(processor.tokenizer)
    assert config.image_token_id == processor.image_token_id

    # Seeded init on CPU in float32, without disturbing the caller's RNG state or default dtype.
    prev_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            model = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
    finally:
        torch.set_default_dtype(prev_dtype)
    model.eval()

    gc = model.generation_config
    gc.bos_token_id = tok.bos_token_id
    gc.eos_token_id = tok.eos_token_id
    gc.pad_token_id = tok.pad_token_id
    gc.do_sample = False
    return model, processor


__all__ = ["ARCHS", "build_tiny", "tiny_image", "build_tokenizer"]
