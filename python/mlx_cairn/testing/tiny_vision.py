"""Tiny random-weight vision-language model folders, built in-process for tests.

Each folder is what a real checkpoint looks like to mlx-vlm: ``config.json``
(with a ``vision_config``), ``model.safetensors`` written from mlx-vlm's own
model class with random weights, a tokenizer (the tiny byte-level BPE of
:mod:`mlx_cairn.testing.tiny_models` plus the family's image and turn tokens), a
chat template that takes content parts, and the processor's configs, so
``mlx_vlm.utils.load`` and ``mlx_cairn.models.load`` both read it.

Example::

    folder = tiny_vision_folder("gemma3", tmp_path)
    lm = mlx_cairn.models.load(str(folder))
    lm.takes_images  # True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from mlx_cairn.testing.tiny_models import TINY_VOCAB, random_weights, tiny_tokenizer

#: Architectures :func:`tiny_vision_folder` builds.
VISION_ARCHES = ("gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "idefics3", "smolvlm", "mistral3")

_GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


_MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% elif block['type'] == 'image' %}[IMG]{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] if message['content'] is string else '' }}{% endif %}"
    "{% endfor %}"
)


#: Pixels to [-1, 1]: the preprocessing of the tiny Gemma 3 and Idefics 3 processors.
_RESCALE_TO_UNIT: dict[str, Any] = {
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _tokenizer(specials: list[str]) -> Any:
    """The tiny BPE with ``specials`` added as special tokens (ids follow its own)."""
    tok = tiny_tokenizer()
    hf = tok.hf
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return hf


def _vit(model_type: str) -> dict[str, Any]:
    """A one-layer ViT of width 32 over 28x28 pictures in 7x7 patches (SigLIP / Idefics3)."""
    return {
        "model_type": model_type,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 7,
        "image_size": 28,
        "layer_norm_eps": 1e-6,
    }


def _text(hidden: int = 64, **kw: Any) -> dict[str, Any]:
    base = {
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TINY_VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
    }
    base.update(kw)
    return base


def _gemma3(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    hf = _tokenizer(
        [
            *("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
            *("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
        ]
    )
    ids = {t: hf.token_to_id(t) for t in ("<bos>", "<eos>", "<end_of_turn>", "<image_soft_token>")}
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": hf.token_to_id("<start_of_image>"),
        "eoi_token_index": hf.token_to_id("<end_of_image>"),
        "mm_tokens_per_image": 4,
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": 0,
        "text_config": _text(
            model_type="gemma3_text",
            num_hidden_layers=3,
            head_dim=16,
            num_key_value_heads=1,
            query_pre_attn_scalar=16,
            sliding_window=8,
            sliding_window_pattern=3,
            mm_tokens_per_image=4,
        ),
        "vision_config": _vit("siglip_vision_model"),
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    }
    files = {
        "preprocessor_config.json": {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": 28, "width": 28},
            **_RESCALE_TO_UNIT,
            "do_convert_rgb": True,
            "do_pan_and_scan": False,
            "resample": 2,
        },
        "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4},
    }
    hf.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(_GEMMA3_TEMPLATE)
    return config, {"tokenizer_config.json": tok_config, **files}


def _qwen3_vl(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    config, files = _qwen2_5_vl(folder)
    text = dict(config["text_config"])
    text.update(model_type="qwen3_vl", head_dim=16)
    text["rope_scaling"] = {
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    for k in list(config):
        if k in text and k != "model_type":
            del config[k]
    config.update(
        model_type="qwen3_vl",
        architectures=["Qwen3VLForConditionalGeneration"],
        text_config=text,
        tie_word_embeddings=False,
    )
    config["vision_config"] = {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
        "in_channels": 3,
    }
    pre = dict(files["preprocessor_config.json"])
    pre.update(
        image_processor_type="Qwen2VLImageProcessorFast",
        processor_class="Qwen3VLProcessor",
        patch_size=16,
        min_pixels=64 * 64,
        max_pixels=64 * 64 * 4,
        size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64 * 4},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    files["preprocessor_config.json"] = pre
    return config, files


def _qwen3_5(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3.5: a hybrid (Gated DeltaNet and attention layers) with Qwen3-VL's tower."""
    from mlx_cairn.testing.tiny_configs import tiny_config

    config, files = _qwen3_vl(folder)
    hybrid = tiny_config("qwen3_5")["text_config"]
    text = {
        **hybrid,
        "model_type": "qwen3_5",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "eos_token_id": config["text_config"].get("eos_token_id"),
        "rope_parameters": {
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
        },
    }
    config.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"])
    config["text_config"] = text
    config["vision_config"] = {**config["vision_config"], "model_type": "qwen3_5"}
    config["vision_config"]["deepstack_visual_indexes"] = []
    files["preprocessor_config.json"]["processor_class"] = "Qwen3VLProcessor"
    return config, files


def _qwen2_5_vl(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    hf = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    text = _text(
        model_type="qwen2_5_vl",
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=hf.token_to_id("<|endoftext|>"),
        eos_token_id=hf.token_to_id("<|im_end|>"),
    )
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    config = {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **text,
        "text_config": dict(text),
        "image_token_id": hf.token_to_id("<|image_pad|>"),
        "video_token_id": hf.token_to_id("<|video_pad|>"),
        "vision_start_token_id": hf.token_to_id("<|vision_start|>"),
        "vision_end_token_id": hf.token_to_id("<|vision_end|>"),
        "eos_token_id": hf.token_to_id("<|im_end|>"),
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
    }
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
    }
    files = {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "min_pixels": 56 * 56,
            "max_pixels": 56 * 56 * 4,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    }
    hf.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(_QWEN_VL_TEMPLATE)
    return config, {"tokenizer_config.json": tok_config, **files}


def _idefics3(folder: Path, model_type: str = "idefics3") -> tuple[dict[str, Any], dict[str, Any]]:
    hf = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"])
    text = _text(model_type="llama", rope_theta=10000.0, tie_word_embeddings=False)
    config = {
        "model_type": model_type,
        "architectures": ["Idefics3ForConditionalGeneration"],
        "image_token_id": hf.token_to_id("<image>"),
        "scale_factor": 2,
        "vocab_size": TINY_VOCAB,
        "eos_token_id": [hf.token_to_id("<end_of_utterance>")],
        "text_config": text,
        "vision_config": _vit("idefics3_vision"),
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<end_of_utterance>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
    }
    proc_class = "SmolVLMProcessor" if model_type == "smolvlm" else "Idefics3Processor"
    ip_class = "SmolVLMImageProcessor" if model_type == "smolvlm" else "Idefics3ImageProcessor"
    files = {
        "preprocessor_config.json": {
            "image_processor_type": ip_class,
            "processor_class": proc_class,
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"longest_edge": 28},
            "resample": 1,
            "do_image_splitting": False,
            "max_image_size": {"longest_edge": 28},
            **_RESCALE_TO_UNIT,
            "do_pad": True,
        },
        "processor_config.json": {"processor_class": proc_class, "image_seq_len": 4},
    }
    hf.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(_IDEFICS3_TEMPLATE)
    return config, {"tokenizer_config.json": tok_config, **files}


def _mistral3(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    hf = _tokenizer(["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    text = _text(model_type="mistral", rope_theta=10000.0, head_dim=16, tie_word_embeddings=False)
    config = {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": hf.token_to_id("[IMG]"),
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "vocab_size": TINY_VOCAB,
        "eos_token_id": hf.token_to_id("</s>"),
        "text_config": text,
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 7,
            "rope_theta": 10000.0,
        },
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    files = {
        "preprocessor_config.json": {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "PixtralProcessor",
            "do_resize": True,
            "size": {"longest_edge": 28},
            "patch_size": {"height": 7, "width": 7},
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
        },
        "processor_config.json": {
            "processor_class": "PixtralProcessor",
            "patch_size": 7,
            "spatial_merge_size": 2,
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
        },
    }
    hf.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(_MISTRAL3_TEMPLATE)
    return config, {"tokenizer_config.json": tok_config, **files}


def tiny_vision_folder(
    arch: str,
    folder: Path,
    seed: int = 0,
    *,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    preprocessor: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight ``arch`` (:data:`VISION_ARCHES`) checkpoint into ``folder``.

    ``text`` / ``vision`` / ``preprocessor`` override entries of the text config,
    the vision config and ``preprocessor_config.json`` (a larger model for a bench)."""
    from mlx_vlm.utils import get_model_and_args

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build = {
        "gemma3": _gemma3,
        "qwen2_5_vl": _qwen2_5_vl,
        "qwen3_vl": _qwen3_vl,
        "qwen3_5": _qwen3_5,
        "idefics3": _idefics3,
        "smolvlm": lambda f: _idefics3(f, "smolvlm"),
        "mistral3": _mistral3,
    }.get(arch)
    if build is None:
        raise ValueError(f"unknown tiny vision architecture {arch!r}")
    config, files = build(folder)
    if text:
        config["text_config"].update(text)
        for k, v in text.items():  # Qwen2.5-VL repeats the text config on top
            if k in config:
                config[k] = v
    if vision:
        config["vision_config"].update(vision)
    if preprocessor:
        files["preprocessor_config.json"].update(preprocessor)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name, body in files.items():
        (folder / name).write_text(json.dumps(body, indent=1))
    arch_module, _ = get_model_and_args(config)
    model_config = arch_module.ModelConfig.from_dict(config)
    for key in ("text_config", "vision_config"):
        sub = getattr(arch_module, "TextConfig" if key == "text_config" else "VisionConfig")
        setattr(model_config, key, sub.from_dict(config[key]))
    model = arch_module.Model(model_config)
    random_weights(model, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder
