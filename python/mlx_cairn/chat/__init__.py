"""Chat templates, tokenizer wrapper and prompt building (docs/design.md §1).

Example::

    from mlx_cairn.chat import ChatTemplate, Tokenizer, build_prompt
"""

from mlx_cairn.chat.detect import (
    PARSER_FAMILIES,
    ReasoningInfo,
    detect_parser_family,
    detect_reasoning,
    starts_in_reasoning,
)
from mlx_cairn.chat.prompt import Prompt, build_prompt
from mlx_cairn.chat.template import ChatTemplate
from mlx_cairn.chat.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "PARSER_FAMILIES",
    "ChatTemplate",
    "IncrementalDetokenizer",
    "Prompt",
    "ReasoningInfo",
    "Tokenizer",
    "build_prompt",
    "detect_parser_family",
    "detect_reasoning",
    "starts_in_reasoning",
]
