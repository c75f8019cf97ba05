"""Model loading and architectures (docs/design.md §1).

Example::

    from mlx_cairn.models import load
    lm = load()                       # the embedded default SmolLM2 GGUF
    lm = load("/path/to/hf-folder")   # HF / MLX-quantized folder, or a .gguf file
"""

from mlx_cairn.models.cache import ContiguousKVCache
from mlx_cairn.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel, ModelArgs
from mlx_cairn.models.loaded import LoadedModel

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ContiguousKVCache",
    "LlamaModel",
    "LoadedModel",
    "ModelArgs",
]

from mlx_cairn.models.loader import default_model_path, load
from mlx_cairn.models.zoo import ZooModel

__all__ += ["ZooModel", "default_model_path", "load"]
