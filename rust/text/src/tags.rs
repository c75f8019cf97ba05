//! Tool-call families and the structural tags each one recognizes.
use std::borrow::Cow;
use std::fmt;
use std::mem::take;
use std::str::FromStr;

use crate::TextError;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`.
    Hermes,
    /// Qwen3-Coder: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
    Qwen3Coder,
    /// Llama 3.x: `<|python_tag|>{json}` or a bare `{"name": .., "parameters": ..}` reply.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": .., "arguments": ..}]` or `[TOOL_CALLS]name[ARGS]{..}`.
    Mistral,
    /// gpt-oss harmony: `<|channel|>analysis<|message|>..<|end|>` reasoning,
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`
    /// calls, `<|channel|>final<|message|>..` answers.
    Harmony,
    /// GLM-4.5 / 4.7: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>..</tool_call>`.
    Glm45,
    /// DeepSeek V3 / V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>..<｜tool▁call▁end｜><｜tool▁calls▁end｜>`.
    DeepSeekV3,
    /// Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{..}<|tool_call_end|>..`.
    KimiK2,
    /// Gemma 4: `<|channel>thought\n..<channel|>` reasoning, `<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>`.
    Gemma4,
    /// MiniMax M2: `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke></minimax:tool_call>`.
    MiniMaxM2,
    /// Llama 3.2 / 4 pythonic: `[f(a=1, b="x"), g()]`, or inside `<|python_start|>..<|python_end|>`.
    Pythonic,
}

impl Family {
    /// The accepted family names, as [`FromStr`] parses them.
    pub const NAMES: [&'static str; 11] = [
        "hermes",
        "qwen3_coder",
        "llama3",
        "mistral",
        "harmony",
        "glm45",
        "deepseek_v3",
        "kimi_k2",
        "gemma4",
        "minimax_m2",
        "pythonic",
    ];

    /// Every family, in [`Family::NAMES`] order.
    pub const ALL: [Family; 11] = [
        Family::Hermes,
        Family::Qwen3Coder,
        Family::Llama3,
        Family::Mistral,
        Family::Harmony,
        Family::Glm45,
        Family::DeepSeekV3,
        Family::KimiK2,
        Family::Gemma4,
        Family::MiniMaxM2,
        Family::Pythonic,
    ];

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Family::Hermes => "hermes",
            Family::Qwen3Coder => "qwen3_coder",
            Family::Llama3 => "llama3",
            Family::Mistral => "mistral",
            Family::Harmony => "harmony",
            Family::Glm45 => "glm45",
            Family::DeepSeekV3 => "deepseek_v3",
            Family::KimiK2 => "kimi_k2",
            Family::Gemma4 => "gemma4",
            Family::MiniMaxM2 => "minimax_m2",
            Family::Pythonic => "pythonic",
        }
    }
}

impl FromStr for Family {
    type Err = TextError;

    fn from_str(s: &str) -> Result<Self, TextError> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| TextError::UnknownFamily(s.to_owned()))
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// End-of-turn and chat-template markers. They are dropped wherever they
/// appear and never reach any segment.
pub const END_MARKERS: &[&str] = &[
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<start_of_turn>",
];

pub(crate) const THINK_OPEN: &str = "<think>";
pub(crate) const THINK_CLOSE: &str = "</think>";
pub(crate) const TOOL_OPEN: &str = "<tool_call>";
pub(crate) const TOOL_CLOSE: &str = "</tool_call>";
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
pub(crate) const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
pub(crate) const MISTRAL_THINK_OPEN: &str = "[THINK]";
pub(crate) const MISTRAL_THINK_CLOSE: &str = "[/THINK]";

/// What a recognized tag means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    ThinkOpen,
    ThinkClose,
    ToolOpen,
    ToolClose,
    PythonCall,
    MistralCalls,
    Marker,
}

/// The tags active in one parser mode. No tag is a prefix of another, so a
/// full match is unambiguous.
#[derive(Debug, Clone, Default)]
pub(crate) struct TagSet {
    tags: Vec<(&'static str, Tag)>,
    /// `[` starts a tag (Mistral), besides `<`.
    pub bracket: bool,
}

/// Result of looking for a tag at a possible tag start.
pub(crate) enum Lookup<T> {
    /// A whole tag of this many bytes.
    Full(T, usize),
    /// The rest of the input is a proper prefix of a tag: wait for more.
    Partial,
    /// Not a tag.
    No,
}

/// Looks for one of `tags` at the start of `rest`. No tag is a prefix of
/// another, so the first whole match is the only one.
pub(crate) fn lookup<T: Copy>(tags: &[(&'static str, T)], rest: &str) -> Lookup<T> {
    let mut partial = false;
    for &(t, v) in tags {
        if rest.starts_with(t) {
            return Lookup::Full(v, t.len());
        }
        if rest.len() < t.len() && t.starts_with(rest) {
            partial = true;
        }
    }
    if partial {
        Lookup::Partial
    } else {
        Lookup::No
    }
}

/// The text to lex next: what the last push `held` back (a possible tag cut
/// by the chunk end) followed by `text`; `held` is left empty.
pub(crate) fn after_held<'a>(held: &mut String, text: &'a str) -> Cow<'a, str> {
    if held.is_empty() {
        Cow::Borrowed(text)
    } else {
        let mut s = take(held);
        s.push_str(text);
        Cow::Owned(s)
    }
}

impl TagSet {
    pub fn new(extra: &[(&'static str, Tag)]) -> Self {
        let mut tags: Vec<(&'static str, Tag)> = extra.to_vec();
        tags.extend(END_MARKERS.iter().map(|m| (*m, Tag::Marker)));
        let bracket = tags.iter().any(|(t, _)| t.starts_with('['));
        TagSet { tags, bracket }
    }

    /// Looks for a tag at the start of `rest` (which begins with `<` or `[`).
    pub fn lookup(&self, rest: &str) -> Lookup<Tag> {
        lookup(&self.tags, rest)
    }

    /// Byte offset of the next possible tag start in `s`.
    pub fn next_candidate(&self, s: &str) -> Option<usize> {
        if self.bracket {
            memchr::memchr2(b'<', b'[', s.as_bytes())
        } else {
            memchr::memchr(b'<', s.as_bytes())
        }
    }
}
