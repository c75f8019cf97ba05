"""Test helpers that ship in the package: tiny random-weight models and engine checks.

Used by the project's own tests and benchmarks, and by anyone testing code
built on mlx-cairn without a model download:

- :mod:`~mlx_cairn.testing.tiny_models`: tiny random-weight models and tokenizers
  built in-process, and mlx-lm's own greedy answer to compare against;
- :mod:`~mlx_cairn.testing.tiny_configs`: small ``config.json`` dicts for
  mlx-lm's architectures;
- :mod:`~mlx_cairn.testing.tiny_embed`, :mod:`~mlx_cairn.testing.tiny_vision`: tiny
  embedding and vision-language model folders;
- :mod:`~mlx_cairn.testing.engine_checks`: the reference loop's tokens and the check
  that an engine is at rest (no KV block, slot or request left behind).
"""
