"""LoadedModel: everything the engine and the server need about one model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_cairn.chat.detect import ReasoningInfo
from mlx_cairn.chat.prompt import Prompt, build_prompt
from mlx_cairn.chat.template import ChatTemplate
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.tool_families import TEMPLATE_FALLBACK, VOCAB_TOKENS
from mlx_cairn.types import ChatRequest

if TYPE_CHECKING:
    from mlx_cairn.models.llama import LlamaModel
    from mlx_cairn.models.vision import Vision
    from mlx_cairn.models.zoo import ZooModel


@dataclass
class LoadedModel:
    """A model, its tokenizer and template, and what was detected about them.

    Example::

        lm = mlx_cairn.models.load()          # the embedded default model
        prompt = lm.prompt(ChatRequest(messages=[Message("user", "Hi")]))
        h = lm.model(mx.array([prompt.ids]), cache)
    """

    name: str
    #: mlx-lm's architecture over our caches (models/zoo.py), or the hand-written Llama.
    model: ZooModel | LlamaModel
    tokenizer: Tokenizer
    template: ChatTemplate
    #: Every id that ends generation (generation_config, tokenizer config, GGUF).
    eos_token_ids: set[int]
    #: Tool-call output format: a family of ``mlx_cairn.tool_families``, or None.
    parser_family: str | None
    reasoning: ReasoningInfo
    context_length: int
    #: Stable name of the weights (and compute dtype); salts the prefix cache.
    identity: str
    #: Where the weights came from ("" for in-process models).
    path: str = ""
    #: Checkpoint format: "hf" | "mlx-quantized" | "gguf" | "memory".
    source_format: str = "hf"
    extra: dict[str, object] = field(default_factory=dict)
    #: The model reads pictures (a vision-language model; /v1/models says so).
    takes_images: bool = False
    #: Its processor and vision-feature cache (models/vision.py), for a vision model.
    vision: Vision | None = None

    def prompt(self, req: ChatRequest) -> Prompt:
        """Render ``req`` through the chat template and tokenize it (for a hybrid
        model, also where its last user message starts: a state snapshot point).
        A vision model's image placeholders become the processor's image tokens."""
        prompt = build_prompt(
            req,
            self.template,
            self.tokenizer,
            self.reasoning,
            locate_last_user=self.has_recurrent_state,
        )
        if self.vision is not None:
            prompt = self.vision.expand(prompt, req)
        return prompt

    @property
    def has_recurrent_state(self) -> bool:
        """Some layer keeps a recurrent state (a hybrid or state-space model)."""
        return any(s.state for s in getattr(self.model, "layer_specs", None) or ())


def assemble(
    *,
    name: str,
    model: ZooModel | LlamaModel,
    tokenizer: Tokenizer,
    template_source: str,
    eos_token_ids: set[int],
    context_length: int,
    identity: str,
    path: str = "",
    source_format: str = "hf",
    parser_family: str | None = "auto",
    reasoning: ReasoningInfo | None = None,
) -> LoadedModel:
    """Build a :class:`LoadedModel`, detecting parser family and reasoning unless given."""
    from mlx_cairn.chat.detect import detect_parser_family, detect_reasoning

    template = ChatTemplate(
        template_source,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
    )
    vocab = {t for t in VOCAB_TOKENS if tokenizer.token_to_id(t) is not None}
    if parser_family == "auto":
        parser_family = detect_parser_family(template_source, vocab)
        if parser_family is None and not template.handles_tools:
            # ChatTemplate spells tools in the Hermes format for such templates.
            parser_family = TEMPLATE_FALLBACK
    if reasoning is None:
        reasoning = detect_reasoning(template_source, vocab)
    if tokenizer.eos_token_id is not None:
        eos_token_ids = {*eos_token_ids, tokenizer.eos_token_id}
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        template=template,
        eos_token_ids=set(eos_token_ids),
        parser_family=parser_family,
        reasoning=reasoning,
        context_length=context_length,
        identity=identity,
        path=path,
        source_format=source_format,
    )


def vocab_size(loaded: Any) -> int:
    """Width of the model's logits (the model's vocabulary, padding included)."""
    for owner in (loaded.model, getattr(loaded.model, "args", None)):
        n = getattr(owner, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return int(loaded.tokenizer.vocab_size)
