"""Tokenizer + LLaVA processor for the ToyWorld tiny VLM (fully offline).

Image tokens: a CLIP ViT on 96x96 images; the bundled target uses patch 32 (``TargetArch.patch_size``:
3 x 3 = 9 patch embeddings + 1 CLS; ``PATCH_SIZE``, 12, is only this module's default). With
``vision_feature_select_strategy="default"`` (LlavaModel drops the CLS feature) and
``num_additional_image_tokens=1``, ``LlavaProcessor`` expands each ``<image>`` to
``(96 // patch) ** 2 + 1 - 1`` placeholders (9 for the bundled target), exactly the patch features
the model scatters into them. :func:`llava_config_kwargs` returns the matching ``LlavaConfig`` fields.

Chat format (``CHAT_TEMPLATE``)::

    <s><|user|>\\n<image>\\n{prompt}\\n<|assistant|>\\n{answer}</s>\\n

The assistant turn always ends with the eos token ``</s>``; ``add_generation_prompt=True`` appends ``<|assistant|>\\n``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

from toyworld import IMAGE_SIZE, iter_split

PATCH_SIZE = 12
# Order fixes the ids: <pad>=0, <s>=1, </s>=2, <image>=3, <|system|>=4, <|user|>=5, <|assistant|>=6.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>", "<|system|>", "<|user|>", "<|assistant|>")
MAX_LENGTH = 1024

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def corpus_for_tokenizer(n: int = 20000) -> Iterator[str]:
    """Prompts and answers of the first ``n`` train samples (2n texts)."""
    for s in iter_split("train", n):
        yield s.prompt
        yield s.answer


def train_tokenizer(texts: Iterable[str], vocab_size: int = 3000) -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE of at most `vocab_size` tokens with the ToyWorld special tokens.
    BPE stops early when no pair occurs twice more: on ToyWorld's corpus (a closed grammar of a
    few hundred words) that happens near 1,000 tokens, once every word is a single token.

    Special tokens take ids 0..6 (see :data:`SPECIAL_TOKENS`); the 256 byte symbols and the BPE
    merges follow. No bos/eos is added by ``encode``: the chat template adds them.
    """
    texts = list(texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS[3:]),
        model_max_length=MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    return hf_tok


def build_processor(tokenizer, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> LlavaProcessor:
    """LlavaProcessor: CLIP-normalised ``image_size`` square images (no crop), 64 ``<image>`` tokens."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    image_processor = CLIPImageProcessor(
        do_resize=True,
        size={"height": image_size, "width": image_size},
        do_center_crop=False,
        crop_size={"height": image_size, "width": image_size},  # used by _get_num_multimodal_tokens
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP CLS, dropped again by the "default" strategy
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )


def num_image_tokens(image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> int:
    return (image_size // patch_size) ** 2


def llava_config_kwargs(processor: LlavaProcessor, image_size: int = IMAGE_SIZE) -> dict:
    """``LlavaConfig`` fields that must agree with :func:`build_processor` (merge in your sizes).

    Use as ``LlavaConfig(text_config=..., vision_config={..., **kw.pop("vision_config")}, **kw)``.
    """
    tok = processor.tokenizer
    return dict(
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        image_seq_length=num_image_tokens(image_size, processor.patch_size),
        vision_config=dict(model_type="clip_vision_model", image_size=image_size, patch_size=processor.patch_size),
        text_config=dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
    )


__all__ = [
    "PATCH_SIZE", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "corpus_for_tokenizer", "train_tokenizer",
    "build_processor", "llava_config_kwargs", "num_image_tokens",
]
