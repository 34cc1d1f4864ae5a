"""The tiny processors' tokenizer (`testing.tiny_processors`): a byte-level BPE trained in
process plus the special tokens a family's processor needs, discovered from the processor class
(its `__init__` defaults, `tokenizer.<x>_token` reads, string literals in its module) or, for tokens
it only reads from the tokenizer, taken from a small table of their real checkpoint strings; and the
generic chat template whose image parts emit the family's placeholder."""

from __future__ import annotations

import functools
import inspect
import re

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from testing.families import NotBuildable
from testing.tiny import trained_bpe


BPE_VOCAB = 640  # byte alphabet (256) + merges; special tokens go on top

MAX_LEN = 4096

# Standard chat-template tokens every tiny tokenizer has (bos/eos/pad + turn markers).
_BASE_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

_TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]

# Names matched by ``tokenizer.<name>`` that are standard tokenizer attributes, not added tokens.
_STANDARD_TOKEN_ATTRS = {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"}

_SPECIAL_LITERAL = re.compile(r"""["'](<[^<>\s"'(){}\\]{1,48}>|\[[A-Z_]{2,24}\])["']""")

# ``vocab["|SPEAKER|"]``: a token the processor looks up in the tokenizer's vocabulary by its literal
_VOCAB_LOOKUP = re.compile(r"""vocab\[\s*["']([^"'\s]{1,48})["']\s*\]""")

_TOKENIZER_ATTR = re.compile(r"tokenizer\.(\w+_token)\b")

# ``hasattr(tokenizer, "x_token")`` / ``getattr(tokenizer, "x_token", default)``: optional, the processor has a default.
_TOKENIZER_OPTIONAL = re.compile(r"""(?:hasattr|getattr)\(\s*(?:self\.)?tokenizer\s*,\s*["'](\w+_token)["']""")

# Real strings of tokens that processors read from ``tokenizer.<name>`` (they come from the
# checkpoint's tokenizer config, so they cannot be discovered from code). Unlisted names fall back
# to ``<|name|>`` with the ``_token`` suffix dropped, which is equally valid for a random model.
_TOKENIZER_TOKEN_VALUES = {
    "gemma": {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "boa_token": "<start_of_audio>",
        "eoa_token": "<end_of_audio>",
        "audio_token": "<audio_soft_token>",
    },
    "cohere2_vision": {
        "boi_token": "<|START_OF_IMG|>",
        "eoi_token": "<|END_OF_IMG|>",
        "image_token": "<|IMG_PATCH|>",
        "img_line_break_token": "<|IMG_LINE_BREAK|>",
    },
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "janus": {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"},
    "chameleon": {"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"},
    "emu3": {
        "image_token": "<image>",
        "boi_token": "<|image start|>",
        "eoi_token": "<|image end|>",
        "image_wrapper_token": "<|image token|>",
        "eof_token": "<|extra_201|>",
    },
    "mllama": {"image_token": "<|image|>"},
    "lighton_ocr": {
        "image_token": "<|image_pad|>",
        "image_break_token": "<|vision_pad|>",
        "image_end_token": "<|vision_end|>",
    },
    "paddleocr_vl": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
    "perception_lm": {"image_token": "<|image|>", "video_token": "<|video|>"},
}

_TOKEN_VALUE_GROUPS = {
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "gemma4": "gemma",
    "gemma4_unified": "gemma",
    "diffusion_gemma": "gemma",
    "shieldgemma2": "gemma",
    "t5gemma2": "gemma",
    "qianfan_ocr": "internvl",
}

@functools.lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    return trained_bpe(BPE_VOCAB).to_str()

def _chat_template(image_placeholder: str) -> str:
    """ChatML-style template; each ``{"type": "image"}`` part renders ``image_placeholder``."""
    image = image_placeholder.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '" + image + "' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )

def build_tokenizer(named: dict[str, str], extra: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (:data:`BPE_VOCAB`) + specials: ``named`` become ``tokenizer.<name>`` attributes.

    ``named`` maps attribute names (``"bos_token"``, ``"image_token"``, ``"boi_token"``...) to token
    strings; ``extra`` are further special tokens without a name. Raises :class:`NotBuildable` when
    the tokenizer would not fit in ``vocab_size``.
    """
    tok = Tokenizer.from_str(_trained_bpe_json())
    ordered = list(dict.fromkeys([*named.values(), *_TURN_TOKENS, *extra]))
    if tok.get_vocab_size() + len(ordered) > vocab_size:
        raise NotBuildable(f"{tok.get_vocab_size()} BPE + {len(ordered)} special tokens > vocab_size {vocab_size}")
    tok.add_special_tokens(ordered)
    standard = {k: v for k, v in named.items() if k in _STANDARD_TOKEN_ATTRS}
    custom = {k: v for k, v in named.items() if k not in _STANDARD_TOKEN_ATTRS}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        extra_special_tokens=custom,
        model_max_length=MAX_LEN,
        padding_side="left",
        **standard,
    )
    leftover = [t for t in ordered if t not in custom.values() and t not in standard.values()]
    if leftover:
        hf_tok.add_special_tokens({"additional_special_tokens": leftover}, replace_extra_special_tokens=False)
    return hf_tok

def _processor_tokens(processor_cls: type, family: str) -> tuple[dict[str, str], list[str]]:
    """Special tokens the processor needs: (``tokenizer.<name>`` attributes, other literals)."""
    source = inspect.getsource(inspect.getmodule(processor_cls))
    init_defaults = {
        k: p.default
        for k, p in inspect.signature(processor_cls.__init__).parameters.items()
        if isinstance(p.default, str)
    }
    values = _TOKENIZER_TOKEN_VALUES.get(_TOKEN_VALUE_GROUPS.get(family, family), {})
    named: dict[str, str] = dict(_BASE_SPECIALS)
    optional = set(_TOKENIZER_OPTIONAL.findall(source))
    for name in sorted(set(_TOKENIZER_ATTR.findall(source)) | (optional & set(values))):
        if name in _STANDARD_TOKEN_ATTRS or (name in optional and name not in values) or name.startswith("add_"):
            continue
        named[name] = values.get(name) or init_defaults.get(name) or f"<|{name.removesuffix('_token')}|>"
    extra = [v for k, v in init_defaults.items() if k.endswith("_token") and v.startswith(("<", "["))]
    extra += _SPECIAL_LITERAL.findall(source)
    extra += _VOCAB_LOOKUP.findall(source)
    extra += [v for v in values.values() if v not in named.values()]
    return named, list(dict.fromkeys(t for t in extra if t not in named.values()))
