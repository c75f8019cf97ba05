//! Streaming parsers for the tool-call formats that are not `<tool_call>`
//! JSON: gpt-oss harmony, GLM-4.5 XML, DeepSeek V3 / V3.1, Kimi K2, Gemma 4,
//! MiniMax M2 and pythonic calls (Llama 3.2 / 4).
//!
//! Every family is a small state machine ([`Machine`]) over a stream of
//! content and tags. [`Driver`] does the lexing once for all of them: at
//! each byte where an active tag may start it decides between a whole tag,
//! a possible tag cut by the chunk end (held back until the next push), or a
//! false alarm (one byte of content). Content reaches a machine in pieces
//! that depend on the chunking, so every machine treats content as a stream:
//! feeding `"ab"` equals feeding `"a"` then `"b"`. That, and tags that are
//! never a prefix of one another within a mode, is the whole any-chunking
//! argument.
//!
//! A tool call's body is collected until its closing tag (or the end of the
//! stream) and parsed then; a body that does not parse comes back as text,
//! tags included, so nothing the model wrote is lost. When generation was
//! cut (`max_tokens`) instead, a call still open at the end is dropped: the
//! model never finished it, and its markup is not an answer.
mod bodies;
mod cursor;
mod gemma;
mod harmony;
mod pythonic;
mod sectioned;

use std::mem::take;

use crate::schema::ToolSchemas;
use crate::tags::{after_held, lookup, Lookup};
use crate::{Family, Segment, ToolCall};

pub(crate) use harmony::Harmony;
pub(crate) use pythonic::Pythonic;
pub(crate) use sectioned::Sectioned;

/// The active tags of one mode, each with what it means to the machine.
#[derive(Debug, Clone)]
pub(crate) struct Tags<T: Copy> {
    tags: Vec<(&'static str, T)>,
    /// Bytes a tag may start with.
    first: [bool; 256],
}

impl<T: Copy> Tags<T> {
    pub fn new(tags: Vec<(&'static str, T)>) -> Self {
        let mut first = [false; 256];
        for (t, _) in &tags {
            debug_assert!(!t.is_empty() && t.is_char_boundary(1));
            first[t.as_bytes()[0] as usize] = true;
        }
        debug_assert!(
            tags.iter()
                .all(|(a, _)| tags.iter().all(|(b, _)| a == b || !b.starts_with(a))),
            "a tag is a prefix of another"
        );
        Tags { tags, first }
    }

    fn next_candidate(&self, s: &str) -> usize {
        s.bytes()
            .position(|b| self.first[b as usize])
            .unwrap_or(s.len())
    }

    fn lookup(&self, rest: &str) -> Lookup<T> {
        lookup(&self.tags, rest)
    }
}

/// Where a machine's output goes: segments, merged as they come, and the
/// rule that whitespace right after a reasoning block or a tool call is
/// template formatting, not an answer.
#[derive(Debug, Clone, Default)]
pub(crate) struct Out {
    pub segs: Vec<Segment>,
    /// Drop leading ASCII whitespace of the next text.
    pub trim: bool,
}

impl Out {
    pub fn text(&mut self, s: &str) {
        let s = if self.trim {
            let t = s.trim_start_matches(|c: char| c.is_ascii_whitespace());
            if t.is_empty() {
                return;
            }
            self.trim = false;
            t
        } else {
            s
        };
        self.push(s, true);
    }

    pub fn reasoning(&mut self, s: &str) {
        self.push(s, false);
    }

    fn push(&mut self, s: &str, text: bool) {
        if s.is_empty() {
            return;
        }
        match (self.segs.last_mut(), text) {
            (Some(Segment::Text(t)), true) | (Some(Segment::Reasoning(t)), false) => t.push_str(s),
            (_, true) => self.segs.push(Segment::Text(s.to_owned())),
            (_, false) => self.segs.push(Segment::Reasoning(s.to_owned())),
        }
    }

    /// Emits parsed calls; the first carries the body's raw text.
    pub fn calls(&mut self, raw: &str, calls: Vec<(String, String)>) {
        for (i, (name, arguments)) in calls.into_iter().enumerate() {
            let raw = if i == 0 {
                raw.to_owned()
            } else {
                String::new()
            };
            self.segs.push(Segment::ToolCall(ToolCall {
                name,
                arguments,
                raw,
            }));
        }
        self.trim = true;
    }

    /// A body that did not parse: its text, tags and all, verbatim.
    pub fn malformed(&mut self, parts: &[&str]) {
        self.trim = false;
        for p in parts {
            self.push(p, true);
        }
    }
}

/// One family's state machine, driven by [`Driver`].
pub(crate) trait Machine {
    type Tok: Copy;
    /// Whitespace that opens the reply is template layout (GLM writes
    /// `\n<think>` after its role tag), dropped like that after a block.
    const TRIM_START: bool = false;
    /// The tags active in the current state.
    fn tags(&self) -> &Tags<Self::Tok>;
    /// Content up to the next possible tag. Returns the bytes consumed:
    /// fewer than `s.len()` only when the state (and so the active tags)
    /// changed, and then at least one byte unless the change alone is
    /// progress.
    fn content(&mut self, s: &str, out: &mut Out) -> usize;
    fn tag(&mut self, t: Self::Tok, out: &mut Out);
    /// End of the stream: whatever is still open. With `cut` (generation
    /// was cut, not finished) a tool call still open is dropped; held text
    /// that is not a call is released all the same.
    fn finish(&mut self, out: &mut Out, cut: bool);
    /// Whether a tool call is open, so that at a cut a possible tag still
    /// held goes with it instead of being released as text. Only needed
    /// where a false alarm would otherwise turn the call's markup into text
    /// (harmony's header); a body drops what it holds anyway.
    fn in_call(&self) -> bool {
        false
    }
    /// The tags that open a tool call where text is read (none by default).
    fn call_opens(&self) -> &[&'static str] {
        &[]
    }
    /// A fresh stream.
    fn reset(&mut self);
}

/// Lexes streamed text for a [`Machine`], holding back possible tags.
#[derive(Debug, Clone)]
pub(crate) struct Driver<M> {
    m: M,
    buf: String,
    out: Out,
}

impl<M: Machine> Driver<M> {
    pub fn new(m: M) -> Self {
        Driver {
            m,
            buf: String::new(),
            out: Self::fresh_out(),
        }
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        let s = after_held(&mut self.buf, text);
        self.process(&s, false);
        out.append(&mut self.out.segs);
    }

    /// Ends the stream; `cut`: see [`Machine::finish`].
    pub fn flush(&mut self, out: &mut Vec<Segment>, cut: bool) {
        let held = take(&mut self.buf);
        // At a cut, what a call holds goes with it, and so does the start of
        // a call-opening tag: the model was writing a call (a lone `<` or
        // `[` is too little to tell and stays text).
        let opening = |t: &&str| held.len() > 1 && held.len() < t.len() && t.starts_with(&held);
        if !(cut && (self.m.in_call() || self.m.call_opens().iter().any(opening))) {
            self.process(&held, true);
        }
        self.m.finish(&mut self.out, cut);
        out.append(&mut self.out.segs);
        self.reset();
    }

    pub fn reset(&mut self) {
        self.buf.clear();
        self.out = Self::fresh_out();
        self.m.reset();
    }

    fn fresh_out() -> Out {
        Out {
            trim: M::TRIM_START,
            ..Out::default()
        }
    }

    fn process(&mut self, s: &str, fin: bool) {
        let mut pos = 0;
        while pos < s.len() {
            let rest = &s[pos..];
            let c = self.m.tags().next_candidate(rest);
            if c > 0 {
                pos += self.m.content(&rest[..c], &mut self.out);
                continue;
            }
            match self.m.tags().lookup(rest) {
                Lookup::Full(t, n) => {
                    pos += n;
                    self.m.tag(t, &mut self.out);
                }
                Lookup::Partial if !fin => {
                    self.buf.push_str(rest);
                    return;
                }
                // Tags start with an ASCII byte, so one byte is one char.
                _ => pos += self.m.content(&rest[..1], &mut self.out),
            }
        }
    }
}

/// The parser for one of the families this module implements.
#[derive(Debug, Clone)]
pub(crate) enum FormatParser {
    Sectioned(Driver<Sectioned>),
    Harmony(Driver<Harmony>),
    Pythonic(Driver<Pythonic>),
}

impl FormatParser {
    /// `None` for the families `OutputParser` implements itself.
    pub fn new(family: Family, reasoning: bool, starts_in_reasoning: bool) -> Option<Self> {
        let spec = match family {
            Family::Hermes | Family::Qwen3Coder | Family::Llama3 | Family::Mistral => return None,
            Family::Harmony => {
                return Some(FormatParser::Harmony(Driver::new(Harmony::new(
                    starts_in_reasoning,
                ))));
            }
            Family::Pythonic => {
                return Some(FormatParser::Pythonic(Driver::new(Pythonic::new(
                    reasoning,
                    starts_in_reasoning,
                ))));
            }
            Family::Glm45 => &sectioned::GLM45,
            Family::DeepSeekV3 => &sectioned::DEEPSEEK_V3,
            Family::KimiK2 => &sectioned::KIMI_K2,
            Family::Gemma4 => &sectioned::GEMMA4,
            Family::MiniMaxM2 => &sectioned::MINIMAX_M2,
        };
        Some(FormatParser::Sectioned(Driver::new(Sectioned::new(
            spec,
            reasoning,
            starts_in_reasoning,
        ))))
    }

    pub fn set_schemas(&mut self, schemas: std::sync::Arc<ToolSchemas>) {
        if let FormatParser::Sectioned(d) = self {
            d.m.schemas = schemas;
        }
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        match self {
            FormatParser::Sectioned(d) => d.push(text, out),
            FormatParser::Harmony(d) => d.push(text, out),
            FormatParser::Pythonic(d) => d.push(text, out),
        }
    }

    pub fn flush(&mut self, out: &mut Vec<Segment>, cut: bool) {
        match self {
            FormatParser::Sectioned(d) => d.flush(out, cut),
            FormatParser::Harmony(d) => d.flush(out, cut),
            FormatParser::Pythonic(d) => d.flush(out, cut),
        }
    }

    pub fn reset(&mut self) {
        match self {
            FormatParser::Sectioned(d) => d.reset(),
            FormatParser::Harmony(d) => d.reset(),
            FormatParser::Pythonic(d) => d.reset(),
        }
    }
}

/// Every tag `family`'s parser reads (end-of-turn markers included), the
/// texts that must reach it when they are special tokens; see
/// [`crate::parser_tags`], which covers the other families.
pub(crate) fn family_tags(family: Family, reasoning: bool) -> Vec<&'static str> {
    let mut tags: Vec<&'static str> = crate::END_MARKERS.to_vec();
    let spec = match family {
        Family::Hermes | Family::Qwen3Coder | Family::Llama3 | Family::Mistral => {
            unreachable!("OutputParser's own families")
        }
        Family::Harmony => {
            tags.extend(harmony::TAGS);
            return tags;
        }
        Family::Pythonic => {
            tags.extend(pythonic::TAGS);
            tags.extend(pythonic::LLAMA_MARKERS);
            if reasoning {
                tags.extend(["<think>", "</think>"]);
            }
            return tags;
        }
        Family::Glm45 => &sectioned::GLM45,
        Family::DeepSeekV3 => &sectioned::DEEPSEEK_V3,
        Family::KimiK2 => &sectioned::KIMI_K2,
        Family::Gemma4 => &sectioned::GEMMA4,
        Family::MiniMaxM2 => &sectioned::MINIMAX_M2,
    };
    tags.extend(spec.tags(reasoning));
    tags
}

/// The end-of-turn markers of [`crate::END_MARKERS`] plus `extra`, as
/// dropped tags, leaving out any in `except` (tags a family gives meaning).
pub(crate) fn markers<T: Copy>(
    extra: &[&'static str],
    except: &[&str],
    tok: T,
) -> Vec<(&'static str, T)> {
    crate::END_MARKERS
        .iter()
        .chain(extra)
        .filter(|m| !except.contains(m))
        .map(|m| (*m, tok))
        .collect()
}
