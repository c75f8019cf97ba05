//! Families whose tool calls sit in one delimited section: text, optional
//! reasoning, and `OPEN body CLOSE` parsed when it closes.
//!
//! | family       | reasoning                 | section                                                  |
//! |--------------|---------------------------|----------------------------------------------------------|
//! | `glm45`      | `<think>..</think>`       | `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>..</tool_call>` |
//! | `deepseek_v3`| `<think>..</think>`       | `<｜tool▁calls▁begin｜>` calls `<｜tool▁calls▁end｜>`       |
//! | `kimi_k2`    | `<think>..</think>`       | `<\|tool_calls_section_begin\|>` calls `<\|tool_calls_section_end\|>` |
//! | `gemma4`     | `<\|channel>thought\n..<channel\|>` | `<\|tool_call>call:NAME{..}<tool_call\|>`       |
//! | `minimax_m2` | `<think>..</think>`       | `<minimax:tool_call><invoke name=..>..</invoke></minimax:tool_call>` |
//!
//! A section tag inside reasoning ends the reasoning: these tags are the
//! models' own special tokens, so a model that writes one is calling.
use std::sync::Arc;

use super::{bodies, gemma, markers, Machine, Out, Tags};
use crate::schema::ToolSchemas;

/// How one family delimits reasoning and tool calls.
pub(crate) struct Spec {
    /// Reasoning open and close tags.
    pub think: (&'static str, &'static str),
    /// A label the model writes at the start of reasoning; dropped.
    pub label: Option<&'static str>,
    /// The reasoning tags are special tokens that only ever mean reasoning,
    /// so they are parsed even when reasoning is off (never shown as text).
    pub always_think: bool,
    /// Tags that open the tool-call section (several spellings).
    pub opens: &'static [&'static str],
    /// Tags that close it (several spellings).
    pub close: &'static [&'static str],
    /// End-of-turn markers besides [`crate::END_MARKERS`]; dropped.
    pub markers: &'static [&'static str],
    /// Tags inside a section, which its body parser reads.
    pub inner: &'static [&'static str],
    /// Whether `close`, met after this much body, ends the section (it may
    /// be value text inside it).
    pub closes: fn(&str) -> bool,
    /// The calls of a whole body, or `None` when it is malformed.
    pub parse: fn(&str, &ToolSchemas) -> bodies::Calls,
}

fn always(_: &str) -> bool {
    true
}

pub(crate) static GLM45: Spec = Spec {
    think: ("<think>", "</think>"),
    label: None,
    always_think: false,
    opens: &["<tool_call>"],
    close: &["</tool_call>"],
    markers: &["<|user|>", "<|assistant|>", "<|observation|>", "<|system|>"],
    inner: bodies::GLM_TAGS,
    closes: bodies::glm_closes,
    parse: bodies::parse_glm,
};

pub(crate) static DEEPSEEK_V3: Spec = Spec {
    think: ("<think>", "</think>"),
    label: None,
    always_think: false,
    opens: &[bodies::DS_CALLS_BEGIN],
    close: &[bodies::DS_CALLS_END],
    markers: &[
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
        "<｜Assistant｜>",
        "<｜User｜>",
    ],
    inner: bodies::DS_TAGS,
    closes: always,
    parse: bodies::parse_deepseek,
};

pub(crate) static KIMI_K2: Spec = Spec {
    think: ("<think>", "</think>"),
    label: None,
    always_think: false,
    // The singular spelling appears in some Kimi releases.
    opens: &[
        "<|tool_calls_section_begin|>",
        "<|tool_call_section_begin|>",
    ],
    close: &["<|tool_calls_section_end|>", "<|tool_call_section_end|>"],
    markers: &[
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
    ],
    inner: bodies::KIMI_TAGS,
    closes: always,
    parse: bodies::parse_kimi,
};

pub(crate) static GEMMA4: Spec = Spec {
    think: ("<|channel>", "<channel|>"),
    label: Some("thought\n"),
    always_think: true,
    opens: &["<|tool_call>"],
    close: &["<tool_call|>"],
    markers: &[
        "<|turn>",
        "<turn|>",
        "<|tool_response>",
        "<tool_response|>",
        "<eos>",
        "<bos>",
        "<|think|>",
    ],
    inner: &[gemma::QUOTE],
    closes: gemma::closes,
    parse: gemma::parse,
};

pub(crate) static MINIMAX_M2: Spec = Spec {
    think: ("<think>", "</think>"),
    label: None,
    always_think: false,
    opens: &["<minimax:tool_call>"],
    close: &["</minimax:tool_call>"],
    markers: &["]~b]", "]~!b[", "[e~["],
    inner: bodies::MINIMAX_TAGS,
    closes: bodies::minimax_closes,
    parse: bodies::parse_minimax,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tok {
    ThinkOpen,
    ThinkClose,
    Open(usize),
    Close(usize),
    Marker,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Reasoning,
    Body,
}

impl Spec {
    /// Every tag the family's parser reads, with reasoning on or off.
    pub fn tags(&self, reasoning: bool) -> impl Iterator<Item = &'static str> {
        let think = reasoning || self.always_think;
        [self.think.0, self.think.1]
            .into_iter()
            .filter(move |_| think)
            .chain(self.opens.iter().copied())
            .chain(self.close.iter().copied())
            .chain(self.markers.iter().copied())
            .chain(self.inner.iter().copied())
    }
}

/// The state machine for one [`Spec`].
#[derive(Clone)]
pub(crate) struct Sectioned {
    spec: &'static Spec,
    starts_in_reasoning: bool,
    pub(super) schemas: Arc<ToolSchemas>,
    text_tags: Tags<Tok>,
    reasoning_tags: Tags<Tok>,
    body_tags: Tags<Tok>,
    mode: Mode,
    /// Which open tag began the body.
    open: usize,
    body: String,
    /// Reasoning held while it may still be the label.
    label: Option<String>,
}

impl std::fmt::Debug for Sectioned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sectioned")
            .field("open", &self.spec.opens[0])
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Sectioned {
    pub fn new(spec: &'static Spec, reasoning: bool, starts_in_reasoning: bool) -> Self {
        let mk = |think: bool, opens: bool, close: bool| {
            let mut v = markers(spec.markers, &[], Tok::Marker);
            if think {
                v.push((spec.think.0, Tok::ThinkOpen));
                v.push((spec.think.1, Tok::ThinkClose));
            }
            if opens {
                v.extend(
                    spec.opens
                        .iter()
                        .enumerate()
                        .map(|(i, t)| (*t, Tok::Open(i))),
                );
            }
            if close {
                v.extend(
                    spec.close
                        .iter()
                        .enumerate()
                        .map(|(i, t)| (*t, Tok::Close(i))),
                );
            }
            Tags::new(v)
        };
        let mut s = Sectioned {
            spec,
            starts_in_reasoning,
            schemas: Arc::default(),
            // Stray closing tags are structure too: they are dropped.
            text_tags: mk(reasoning || spec.always_think, true, true),
            reasoning_tags: mk(true, true, false),
            body_tags: mk(false, false, true),
            mode: Mode::Text,
            open: 0,
            body: String::new(),
            label: None,
        };
        s.reset();
        s
    }

    fn enter_reasoning(&mut self) {
        self.mode = Mode::Reasoning;
        self.label = self.spec.label.map(|_| String::new());
    }

    /// Releases reasoning held as a possible label.
    fn end_label(&mut self, out: &mut Out) {
        if let Some(held) = self.label.take() {
            out.reasoning(&held);
        }
    }

    fn reasoning_content(&mut self, s: &str, out: &mut Out) {
        let (Some(held), Some(label)) = (self.label.as_mut(), self.spec.label) else {
            return out.reasoning(s);
        };
        held.push_str(s);
        if let Some(rest) = held.strip_prefix(label) {
            out.reasoning(rest);
            self.label = None;
        } else if !label.starts_with(held.as_str()) {
            self.end_label(out);
        }
    }

    /// `closed`: the index of the tag that closed the body, if one did.
    fn finish_body(&mut self, closed: Option<usize>, out: &mut Out) {
        self.mode = Mode::Text;
        let body = std::mem::take(&mut self.body);
        match (self.spec.parse)(&body, &self.schemas) {
            Some(calls) if !calls.is_empty() => out.calls(&body, calls),
            _ => {
                let close = closed.map_or("", |i| self.spec.close[i]);
                out.malformed(&[self.spec.opens[self.open], &body, close]);
            }
        }
    }
}

impl Machine for Sectioned {
    type Tok = Tok;
    const TRIM_START: bool = true;

    fn tags(&self) -> &Tags<Tok> {
        match self.mode {
            Mode::Text => &self.text_tags,
            Mode::Reasoning => &self.reasoning_tags,
            Mode::Body => &self.body_tags,
        }
    }

    fn content(&mut self, s: &str, out: &mut Out) -> usize {
        match self.mode {
            Mode::Text => out.text(s),
            Mode::Reasoning => self.reasoning_content(s, out),
            Mode::Body => self.body.push_str(s),
        }
        s.len()
    }

    fn tag(&mut self, t: Tok, out: &mut Out) {
        match (self.mode, t) {
            (Mode::Text, Tok::ThinkOpen) => self.enter_reasoning(),
            (Mode::Reasoning, Tok::ThinkClose) => {
                self.end_label(out);
                self.mode = Mode::Text;
                out.trim = true;
            }
            (Mode::Text | Mode::Reasoning, Tok::Open(i)) => {
                self.end_label(out);
                self.mode = Mode::Body;
                self.open = i;
                self.body.clear();
            }
            (Mode::Body, Tok::Close(i)) => {
                if (self.spec.closes)(&self.body) {
                    self.finish_body(Some(i), out);
                } else {
                    self.body.push_str(self.spec.close[i]);
                }
            }
            // Markers, stray closing tags, an open tag inside reasoning.
            _ => {}
        }
    }

    fn finish(&mut self, out: &mut Out, cut: bool) {
        match self.mode {
            Mode::Text => {}
            Mode::Reasoning => self.end_label(out),
            // The section never closed: it goes whole, calls complete inside
            // it too (none was returned yet; a batch cut short is not the
            // batch the model meant).
            Mode::Body if cut => self.body.clear(),
            Mode::Body => self.finish_body(None, out),
        }
    }

    fn call_opens(&self) -> &[&'static str] {
        match self.mode {
            Mode::Text => self.spec.opens,
            _ => &[],
        }
    }

    fn reset(&mut self) {
        self.mode = Mode::Text;
        self.body.clear();
        self.label = None;
        self.open = 0;
        if self.starts_in_reasoning {
            self.enter_reasoning();
        }
    }
}
