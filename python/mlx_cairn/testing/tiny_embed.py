"""Tiny random-weight embedding models saved as HF folders, for tests.

Each folder is laid out as its family ships on the hub: ``config.json``,
``model.safetensors`` under the checkpoint's own names, a ``tokenizer.json``
whose post-processor adds the family's specials, and for some the
sentence-transformers files (``modules.json``, ``1_Pooling/config.json``).

Example::

    folder = save_tiny_embedding("bert", tmp_path / "bert")
    em = load_embedding_model(folder)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from mlx_cairn.testing.tiny_configs import tiny_config
from mlx_cairn.testing.tiny_models import random_weights, tiny_tokenizer, trained_bpe

#: The families :func:`save_tiny_embedding` writes.
TINY_EMBEDDERS = ("bert", "xlm_roberta", "modernbert", "qwen3")

#: Width of every tiny encoder.
_DIMS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}


def _bpe(specials: list[str], bos: str, eos: str) -> HFTokenizer:
    """A byte-level BPE (trained on the tiny corpus) wrapping each text in ``bos ... eos``."""
    tok = trained_bpe(320, specials)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))],
    )
    return tok


def _encoder_config(family: str, vocab: int) -> dict[str, Any]:
    if family == "bert":
        return {
            "model_type": "bert",
            "architectures": ["BertModel"],
            **_DIMS,
            "max_position_embeddings": 128,
            "type_vocab_size": 2,
            "vocab_size": vocab,
            "pad_token_id": 0,
            "layer_norm_eps": 1e-12,
        }
    if family == "xlm_roberta":
        return {
            "model_type": "xlm-roberta",
            "architectures": ["XLMRobertaModel"],
            **_DIMS,
            "max_position_embeddings": 66,  # 64 tokens: positions start at pad_token_id + 1
            "type_vocab_size": 1,
            "vocab_size": vocab,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "layer_norm_eps": 1e-5,
        }
    return {
        "model_type": "modernbert",
        "architectures": ["ModernBertModel"],
        **_DIMS,
        "num_hidden_layers": 3,  # one global layer, two sliding ones
        "global_attn_every_n_layers": 3,
        "local_attention": 8,  # windows of a few tokens, so test inputs cross them
        "max_position_embeddings": 256,
        "vocab_size": vocab,
        "pad_token_id": 1,
        "cls_token_id": 0,
        "sep_token_id": 2,
    }


def _encoder_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Random weights under the HF checkpoint names (mlx-embeddings uses the same ones)."""
    import importlib

    from mlx_cairn.models.embedding import ENCODER_TYPES

    arch = importlib.import_module(f"mlx_embeddings.models.{ENCODER_TYPES[config['model_type']]}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    random_weights(model, seed)
    # ModernBertModel checkpoints hold the backbone alone (mlx-embeddings prefixes "model.").
    owner: nn.Module = model.model if config["model_type"] == "modernbert" else model
    flat: list[tuple[str, mx.array]] = tree_flatten(owner.parameters())  # type: ignore[assignment]
    return dict(flat)


def _decoder_folder(out: Path, seed: int) -> None:
    """A Qwen3-Embedding-shaped folder: mlx-lm's qwen3, weights saved from the bare
    backbone (no ``model.`` prefix, no LM head), an EOS closing every input, and the
    sentence-transformers files asking for last-token pooling and normalization."""
    from mlx_cairn.models.zoo import build_model

    config = tiny_config("qwen3") | {"architectures": ["Qwen3ForCausalLM"]}
    model = build_model(config, None)
    random_weights(model, seed)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.model.parameters())  # type: ignore[assignment]
    mx.save_safetensors(str(out / "model.safetensors"), dict(flat))
    tok = tiny_tokenizer().hf
    eos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _sentence_transformers(out, "pooling_mode_lasttoken", max_seq_length=512)


def _sentence_transformers(out: Path, pooling: str, *, max_seq_length: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    keys = [
        "pooling_mode_cls_token",
        "pooling_mode_mean_tokens",
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    ]
    pool = {"word_embedding_dimension": 64, **{k: k == pooling for k in keys}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    st = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (out / "sentence_bert_config.json").write_text(json.dumps(st, indent=2))


def save_tiny_embedding(family: str, path: str | Path, seed: int = 0, **config: Any) -> Path:
    """Write a tiny ``family`` embedding model (:data:`TINY_EMBEDDERS`) to ``path``.

    ``config`` entries are merged into its ``config.json`` (e.g.
    ``matryoshka_dimensions=[16, 32]``). The XLM-R folder asks for CLS pooling
    through sentence-transformers files; BERT and ModernBERT pool the mean (the
    default without them).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if family == "qwen3":
        _decoder_folder(out, seed)
    else:
        if family == "bert":
            tok = _bpe(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS]", "[SEP]")
        else:  # RoBERTa's ids: <s> 0, <pad> 1, </s> 2, <unk> 3
            tok = _bpe(["<s>", "<pad>", "</s>", "<unk>"], "<s>", "</s>")
        cfg = _encoder_config(family, int(tok.get_vocab_size()))
        mx.save_safetensors(str(out / "model.safetensors"), _encoder_weights(cfg, seed))
        tok.save(str(out / "tokenizer.json"))
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        if family == "xlm_roberta":
            _sentence_transformers(out, "pooling_mode_cls_token", max_seq_length=48)
    if config:
        path_cfg = out / "config.json"
        path_cfg.write_text(json.dumps(json.loads(path_cfg.read_text()) | config, indent=2))
    return out
