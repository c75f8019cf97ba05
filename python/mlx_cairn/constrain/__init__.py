"""Grammar-constrained decoding: structured outputs and forced or strict tool calls.

One concern, one package (docs/design.md §2):

- :mod:`~mlx_cairn.constrain.grammar`: the token vocabulary per tokenizer, JSON
  schemas made interoperable and closed, and :class:`GrammarMask`, the engine's
  row-mask seam over the Rust ``cairn-constrain`` crate (llguidance);
- :mod:`~mlx_cairn.constrain.compile`: the grammar one request asks for
  (forced or strict tool calls, a structured output), compiled or refused;
- :mod:`~mlx_cairn.constrain.tool_grammars`: a tool call in each parser family's
  own syntax, as an llguidance Lark grammar;
- :mod:`~mlx_cairn.constrain.tool_values`: argument values in the syntaxes that
  are not JSON;
- :mod:`~mlx_cairn.constrain.lark_text`: building Lark grammar text.

Example::

    from mlx_cairn import constrain
    vocab = constrain.vocabulary(loaded)
    compiled = vocab.compile_json_schema('{"type": "object"}')
"""

from mlx_cairn.constrain import grammar
from mlx_cairn.constrain.grammar import *  # noqa: F403 (the package's API is grammar's __all__)

__all__ = list(grammar.__all__)
