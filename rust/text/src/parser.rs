//! Streaming output parser: visible text, `<think>` reasoning and tool calls.
//!
//! The parser is a small state machine over modes. In each mode a set of
//! tags is active ([`TagSet`]); at every `<` (or `[` for Mistral) it decides
//! between a whole tag, a possible tag cut by the chunk end (held back until
//! the next push), or a false alarm (released as content). Content goes to
//! the sink of the mode: visible text, reasoning, or a tool-call body that
//! is parsed when its closing tag (or the end of the stream) arrives.
//!
//! Tool-call arguments often carry code, and code can contain the very tag
//! text that delimits the call, so inside a body tags count only outside
//! JSON strings; `body` says where each family's body ends.
mod body;

use std::mem::take;

use crate::formats::FormatParser;
use crate::json_scan::JsonScan;
use crate::schema::ToolSchemas;
use crate::tags::{after_held, Lookup, Tag, TagSet};
use crate::tags::{MISTRAL_CALLS, PYTHON_TAG, THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN};
use crate::tags::{MISTRAL_THINK_CLOSE, MISTRAL_THINK_OPEN};
use crate::toolcall;
use crate::{Family, TextError};

/// A parsed tool call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ToolCall {
    pub name: String,
    /// JSON text of an object (`{}` when the call has no arguments).
    pub arguments: String,
    /// The model's text for this call, without the enclosing tags. When one
    /// body holds several calls the first carries it and the rest are empty.
    pub raw: String,
}

/// One piece of parsed model output.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Segment {
    Text(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Reasoning,
    /// Inside `<tool_call>` (Hermes JSON or Qwen3-Coder `<function=..>`),
    /// up to a `</tool_call>` outside JSON strings that
    /// [`toolcall::tagged_close_ends`] accepts.
    Tagged,
    /// After Llama's `<|python_tag|>`, up to an end marker outside JSON
    /// strings, or the end.
    Python,
    /// After Mistral's `[TOOL_CALLS]`, up to the next one or an end marker
    /// outside JSON strings, or the end.
    Mistral,
    /// A Llama reply that opens with `{`: maybe a bare JSON call, up to the
    /// bracket that closes it (brackets inside strings do not count).
    BareJson,
}

/// Splits streamed model text into [`Segment`]s.
///
/// - End-of-turn markers ([`crate::END_MARKERS`]) are dropped everywhere.
/// - With `reasoning`, `<think>..</think>` becomes reasoning; with
///   `starts_in_reasoning` the stream begins inside it (templates that open
///   `<think>` in the prompt). Without `reasoning` those tags are plain text.
/// - Without a family, tool-call tags are plain text.
/// - A malformed tool call comes back as text, tags included; at
///   [`OutputParser::flush_cut`] (generation cut by `max_tokens`) a call
///   still open is dropped instead.
/// - Tag text inside a tool call's JSON strings (or a Qwen3-Coder value) is
///   part of the call; only end-of-turn markers are dropped there too.
/// - Whitespace right after a reasoning block or a tool call is dropped (it
///   is template formatting, not an answer).
///
/// ```
/// use cairn_text::{Family, OutputParser, Segment};
/// let mut p = OutputParser::new(Some(Family::Hermes), false, false).unwrap();
/// let mut segs = p.push("Hi<tool_");
/// segs.extend(p.push(r#"call>{"name": "f", "arguments": {}}</tool_call>"#));
/// segs.extend(p.flush());
/// assert_eq!(segs[0], Segment::Text("Hi".into()));
/// assert!(matches!(&segs[1], Segment::ToolCall(c) if c.name == "f"));
/// ```
#[derive(Debug, Clone)]
pub struct OutputParser {
    family: Option<Family>,
    reasoning: bool,
    starts_in_reasoning: bool,
    text_tags: TagSet,
    reasoning_tags: TagSet,
    tagged_tags: TagSet,
    /// End markers alone: Python and bare JSON bodies, and JSON strings.
    marker_tags: TagSet,
    mistral_tags: TagSet,
    mode: Mode,
    /// Input held back because it may be the start of a tag.
    buf: String,
    /// The tool-call body being collected.
    body: String,
    /// String state of `body`; it sees every byte pushed to `body`.
    json: JsonScan,
    /// Whitespace held while `lead` is set.
    pending: String,
    /// At the start of a text run whose leading whitespace is held.
    lead: bool,
    /// Drop that leading whitespace (it follows a block).
    trim: bool,
    /// Llama: no visible text yet, so a `{` may open a bare JSON call.
    detect_bare: bool,
    /// Llama: just after a call, where `;` separates calls.
    after_call: bool,
    out: Vec<Segment>,
    /// The parser of a family in [`crate::formats`]; it then does all the work.
    fmt: Option<Box<FormatParser>>,
}

impl OutputParser {
    /// A parser for `family` (`None`: no tool calls) with optional reasoning.
    pub fn new(
        family: Option<Family>,
        reasoning: bool,
        starts_in_reasoning: bool,
    ) -> Result<Self, TextError> {
        if starts_in_reasoning && !reasoning {
            return Err(TextError::ReasoningOff);
        }
        let mut think = vec![(THINK_OPEN, Tag::ThinkOpen), (THINK_CLOSE, Tag::ThinkClose)];
        if family == Some(Family::Mistral) {
            // Magistral / Ministral 3 Reasoning think in `[THINK]..[/THINK]`
            // (special tokens); older Magistral releases wrote `<think>`.
            think.extend([
                (MISTRAL_THINK_OPEN, Tag::ThinkOpen),
                (MISTRAL_THINK_CLOSE, Tag::ThinkClose),
            ]);
        }
        let mut text: Vec<(&'static str, Tag)> = Vec::new();
        if reasoning {
            text.extend(think.iter().copied());
        }
        match family {
            Some(Family::Hermes | Family::Qwen3Coder) => {
                text.extend([(TOOL_OPEN, Tag::ToolOpen), (TOOL_CLOSE, Tag::ToolClose)])
            }
            Some(Family::Llama3) => text.push((PYTHON_TAG, Tag::PythonCall)),
            Some(Family::Mistral) => text.push((MISTRAL_CALLS, Tag::MistralCalls)),
            // `fmt` parses these; the tag sets below are unused.
            Some(_) | None => {}
        }
        let mut p = OutputParser {
            family,
            reasoning,
            starts_in_reasoning,
            text_tags: TagSet::new(&text),
            reasoning_tags: TagSet::new(&think),
            tagged_tags: TagSet::new(&[(TOOL_CLOSE, Tag::ToolClose)]),
            marker_tags: TagSet::new(&[]),
            mistral_tags: TagSet::new(&[(MISTRAL_CALLS, Tag::MistralCalls)]),
            mode: Mode::Text,
            buf: String::new(),
            body: String::new(),
            json: JsonScan::default(),
            pending: String::new(),
            lead: false,
            trim: false,
            detect_bare: false,
            after_call: false,
            out: Vec::new(),
            fmt: family
                .and_then(|f| FormatParser::new(f, reasoning, starts_in_reasoning))
                .map(Box::new),
        };
        p.reset();
        Ok(p)
    }

    /// Sets the request's tool schemas, which decide whether a raw-text
    /// argument value (GLM-4.5, MiniMax M2) is a string or JSON; see
    /// [`ToolSchemas`]. Other families' arguments carry their own types.
    pub fn set_tool_schemas(&mut self, schemas: ToolSchemas) {
        if let Some(f) = &mut self.fmt {
            f.set_schemas(std::sync::Arc::new(schemas));
        }
    }

    /// The tool-call family, if any.
    pub fn family(&self) -> Option<Family> {
        self.family
    }

    /// Whether `<think>` reasoning is parsed.
    pub fn reasoning(&self) -> bool {
        self.reasoning
    }

    /// Whether the stream starts inside reasoning.
    pub fn starts_in_reasoning(&self) -> bool {
        self.starts_in_reasoning
    }

    /// Forgets all state: a fresh stream with the same settings.
    pub fn reset(&mut self) {
        if let Some(f) = &mut self.fmt {
            f.reset();
        }
        let llama = self.family == Some(Family::Llama3);
        self.mode = if self.starts_in_reasoning {
            Mode::Reasoning
        } else {
            Mode::Text
        };
        self.buf.clear();
        self.body.clear();
        self.pending.clear();
        self.json.reset();
        self.lead = llama;
        self.trim = false;
        self.detect_bare = llama;
        self.after_call = false;
        self.out.clear();
    }

    /// Feeds `text`; returns the segments completed by it (adjacent text or
    /// reasoning pieces already merged).
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        let mut out = Vec::new();
        self.push_into(text, &mut out);
        out
    }

    /// Like [`OutputParser::push`], appending to `out`.
    pub fn push_into(&mut self, text: &str, out: &mut Vec<Segment>) {
        if let Some(f) = &mut self.fmt {
            let mut segs = Vec::new();
            f.push(text, &mut segs);
            return Self::drain(&mut segs, out);
        }
        let s = after_held(&mut self.buf, text);
        self.process(&s, false);
        Self::drain(&mut self.out, out);
    }

    /// Ends the stream (the model finished: end of turn, a stop sequence):
    /// releases held text, parses an unclosed tool call (as text when it
    /// does not parse), and resets the parser for a new stream.
    pub fn flush(&mut self) -> Vec<Segment> {
        self.finish(false)
    }

    /// Like [`OutputParser::flush`], appending to `out`.
    pub fn flush_into(&mut self, out: &mut Vec<Segment>) {
        self.end(false, out);
    }

    /// Ends a stream that was cut (generation hit `max_tokens`): releases
    /// held text exactly as [`flush`] does (a possible tag that never
    /// completed is text), but drops a tool call that is still open, so none
    /// of its markup reaches the text, and no truncated argument runs.
    ///
    /// Open means the model never wrote the call's end, however complete
    /// the arguments look: `<tool_call>` without `</tool_call>`, a
    /// `<|python_tag|>` or last `[TOOL_CALLS]` body (they end only with the
    /// stream), a family's call section without its closing tag (dropped
    /// whole), a harmony call message without `<|call|>` (or a header that
    /// already names a tool), `<|python_start|>` without `<|python_end|>`.
    /// Where a reply may be a call or the answer, it is open only once it
    /// looks like a call: a Llama reply `{"name"` / `{"function"`, a
    /// pythonic `[name(`; `{"answer": 4` or `[1, 2` stay text. Calls and
    /// reasoning already returned stay. Resets the parser.
    ///
    /// ```
    /// use cairn_text::{Family, OutputParser, Segment};
    /// let mut p = OutputParser::new(Some(Family::Hermes), false, false).unwrap();
    /// let mut segs = p.push(r#"Checking.<tool_call>{"name": "f", "argu"#);
    /// segs.extend(p.flush_cut());
    /// assert_eq!(OutputParser::coalesce(segs), vec![Segment::Text("Checking.".into())]);
    /// ```
    ///
    /// [`flush`]: OutputParser::flush
    pub fn flush_cut(&mut self) -> Vec<Segment> {
        self.finish(true)
    }

    /// [`flush_cut`] when `cut`, else [`flush`].
    ///
    /// [`flush`]: OutputParser::flush
    /// [`flush_cut`]: OutputParser::flush_cut
    pub fn finish(&mut self, cut: bool) -> Vec<Segment> {
        let mut out = Vec::new();
        self.end(cut, &mut out);
        out
    }

    /// Like [`OutputParser::flush_cut`], appending to `out`.
    pub fn flush_cut_into(&mut self, out: &mut Vec<Segment>) {
        self.end(true, out);
    }

    /// Whether `held` (a possible tag held back at the end) is the start of
    /// the family's call-opening tag: at a cut the model was writing a call
    /// (`<tool_call` under a forced choice), so it is markup, not an answer.
    /// A lone `<` or `[` is too little to tell and stays text.
    fn opens_call(&self, held: &str) -> bool {
        let open = match self.family {
            Some(Family::Hermes | Family::Qwen3Coder) => TOOL_OPEN,
            Some(Family::Llama3) => PYTHON_TAG,
            Some(Family::Mistral) => MISTRAL_CALLS,
            _ => return false,
        };
        held.len() > 1 && held.len() < open.len() && open.starts_with(held)
    }

    /// The end of the stream; `cut`: generation was cut, not finished.
    fn end(&mut self, cut: bool, out: &mut Vec<Segment>) {
        if let Some(f) = &mut self.fmt {
            let mut segs = Vec::new();
            f.flush(&mut segs, cut);
            return Self::drain(&mut segs, out);
        }
        let held = take(&mut self.buf);
        if !(cut && self.mode == Mode::Text && self.opens_call(&held)) {
            self.process(&held, true);
        }
        loop {
            match self.mode {
                Mode::Text | Mode::Reasoning => {
                    if self.lead && !self.trim {
                        let p = take(&mut self.pending);
                        self.emit_text(&p);
                    }
                }
                // The model never finished the call: a truncated argument
                // must not run, and its markup is not an answer.
                Mode::Tagged | Mode::Python | Mode::Mistral if cut => self.body.clear(),
                Mode::BareJson if cut && toolcall::looks_like_llama_call(&self.body) => {
                    self.body.clear()
                }
                Mode::Tagged => self.finish_body(TOOL_OPEN, "", toolcall::parse_tagged_body),
                Mode::Python => self.finish_body(PYTHON_TAG, "", toolcall::parse_llama),
                Mode::Mistral => self.finish_body(MISTRAL_CALLS, "", toolcall::parse_mistral),
                Mode::BareJson => {
                    // Still open at the end: not a complete call.
                    let body = take(&mut self.body);
                    self.not_bare();
                    self.process(&body, true);
                    continue;
                }
            }
            break;
        }
        Self::drain(&mut self.out, out);
        self.reset();
    }

    /// Merges adjacent text (and adjacent reasoning) segments and drops
    /// empty ones: the canonical form [`parse_output`] returns.
    pub fn coalesce(segs: impl IntoIterator<Item = Segment>) -> Vec<Segment> {
        let mut out = Vec::new();
        Self::drain_iter(segs, &mut out);
        out
    }

    fn drain(from: &mut Vec<Segment>, to: &mut Vec<Segment>) {
        if to.is_empty() {
            std::mem::swap(from, to);
        } else {
            Self::drain_iter(from.drain(..), to);
        }
    }

    fn drain_iter(segs: impl IntoIterator<Item = Segment>, to: &mut Vec<Segment>) {
        for s in segs {
            match (to.last_mut(), s) {
                (_, Segment::Text(t) | Segment::Reasoning(t)) if t.is_empty() => {}
                (Some(Segment::Text(a)), Segment::Text(b)) => a.push_str(&b),
                (Some(Segment::Reasoning(a)), Segment::Reasoning(b)) => a.push_str(&b),
                (_, s) => to.push(s),
            }
        }
    }

    fn tags(&self) -> &TagSet {
        match self.mode {
            Mode::Text => &self.text_tags,
            Mode::Reasoning => &self.reasoning_tags,
            Mode::Tagged => &self.tagged_tags,
            Mode::Python | Mode::BareJson => &self.marker_tags,
            Mode::Mistral => &self.mistral_tags,
        }
    }

    fn process(&mut self, s: &str, fin: bool) {
        let mut pos = 0;
        while pos < s.len() {
            let rest = &s[pos..];
            // Content runs up to `c`, where a tag may start.
            let c = match self.mode {
                Mode::Text | Mode::Reasoning => {
                    self.tags().next_candidate(rest).unwrap_or(rest.len())
                }
                _ => {
                    let (n, closed) = self.body_content(rest);
                    pos += n;
                    if closed && self.mode == Mode::BareJson {
                        if let Some(body) = self.finish_bare() {
                            // Not a call after all: it is text, tags and all.
                            let again = body + &s[pos..];
                            return self.process(&again, fin);
                        }
                    }
                    if n > 0 {
                        continue;
                    }
                    0
                }
            };
            if c > 0 {
                pos += self.content(&rest[..c]);
                continue;
            }
            let in_str = self.in_json_string();
            let tags = if in_str {
                &self.marker_tags
            } else {
                self.tags()
            };
            match tags.lookup(rest) {
                Lookup::Full(tag, n) => {
                    pos += n;
                    // In a string the only tags are markers: dropped, no more.
                    if !in_str {
                        self.on_tag(tag);
                    }
                }
                Lookup::Partial if !fin => {
                    self.buf.push_str(rest);
                    return;
                }
                // A lone `<` or `[` is content (both are one byte).
                _ => pos += self.content(&rest[..1]),
            }
        }
    }

    /// Sends content to the current mode's sink; returns the bytes consumed
    /// (fewer than `s.len()` only when a bare JSON call starts).
    fn content(&mut self, s: &str) -> usize {
        match self.mode {
            Mode::Text => self.text_sink(s),
            Mode::Reasoning => {
                Self::push_seg(&mut self.out, s, false);
                s.len()
            }
            Mode::Tagged | Mode::Python | Mode::Mistral | Mode::BareJson => {
                self.body_push(s);
                s.len()
            }
        }
    }

    fn text_sink(&mut self, s: &str) -> usize {
        let mut i = 0;
        if self.lead {
            let b = s.as_bytes();
            while i < b.len() && (b[i].is_ascii_whitespace() || (self.after_call && b[i] == b';')) {
                i += 1;
            }
            self.pending.push_str(&s[..i]);
            if i == b.len() {
                return i;
            }
            if self.detect_bare && b[i] == b'{' {
                self.mode = Mode::BareJson;
                self.body = take(&mut self.pending);
                self.json.reset();
                return i;
            }
            let p = take(&mut self.pending);
            if !self.trim {
                self.emit_text(&p);
            }
            self.lead = false;
            self.trim = false;
            self.detect_bare = false;
            self.after_call = false;
        }
        self.emit_text(&s[i..]);
        s.len()
    }

    fn on_tag(&mut self, tag: Tag) {
        match (self.mode, tag) {
            (_, Tag::Marker) if self.mode != Mode::Python && self.mode != Mode::Mistral => {}
            (Mode::Text, Tag::ThinkOpen) => {
                self.pending.clear();
                self.mode = Mode::Reasoning;
            }
            (Mode::Text, Tag::ToolOpen) => self.open_body(Mode::Tagged),
            (Mode::Text, Tag::PythonCall) => self.open_body(Mode::Python),
            (Mode::Text, Tag::MistralCalls) => self.open_body(Mode::Mistral),
            (Mode::Reasoning, Tag::ThinkClose) => {
                self.mode = Mode::Text;
                self.block_end();
            }
            (Mode::Tagged, Tag::ToolClose) => {
                if toolcall::tagged_close_ends(&self.body) {
                    self.finish_body(TOOL_OPEN, TOOL_CLOSE, toolcall::parse_tagged_body)
                } else {
                    // Inside a Qwen3-Coder value: the tag is value text.
                    self.body_push(TOOL_CLOSE);
                }
            }
            (Mode::Python, Tag::Marker) => self.finish_body(PYTHON_TAG, "", toolcall::parse_llama),
            (Mode::Mistral, Tag::Marker) => {
                self.finish_body(MISTRAL_CALLS, "", toolcall::parse_mistral)
            }
            (Mode::Mistral, Tag::MistralCalls) => {
                self.finish_body(MISTRAL_CALLS, "", toolcall::parse_mistral);
                self.open_body(Mode::Mistral);
            }
            // Stray closing tags and `<think>` inside reasoning carry no meaning.
            _ => {}
        }
    }

    fn block_end(&mut self) {
        self.lead = true;
        self.trim = true;
        self.pending.clear();
    }

    fn not_bare(&mut self) {
        self.mode = Mode::Text;
        self.detect_bare = false;
        self.lead = false;
        self.trim = false;
        self.after_call = false;
    }

    fn emit_text(&mut self, s: &str) {
        Self::push_seg(&mut self.out, s, true);
    }

    fn push_seg(out: &mut Vec<Segment>, s: &str, text: bool) {
        if s.is_empty() {
            return;
        }
        match (out.last_mut(), text) {
            (Some(Segment::Text(t)), true) | (Some(Segment::Reasoning(t)), false) => t.push_str(s),
            (_, true) => out.push(Segment::Text(s.to_owned())),
            (_, false) => out.push(Segment::Reasoning(s.to_owned())),
        }
    }
}

/// Every tag the parser for `family` (`None`: no tool calls) reads with
/// these settings: tool-call and reasoning tags and the end-of-turn markers
/// it drops. These are the special tokens a detokenizer must keep for it;
/// any other special token is not the parser's and would show as text.
///
/// ```
/// use cairn_text::{parser_tags, Family};
/// assert!(parser_tags(Some(Family::Mistral), true).contains(&"[THINK]"));
/// assert!(parser_tags(Some(Family::Llama3), false).contains(&"<|python_tag|>"));
/// assert!(!parser_tags(None, false).contains(&"<think>"));
/// ```
pub fn parser_tags(family: Option<Family>, reasoning: bool) -> Vec<&'static str> {
    let mut tags = Vec::new();
    match family {
        None => {}
        Some(Family::Hermes | Family::Qwen3Coder) => {
            tags.extend([TOOL_OPEN, TOOL_CLOSE]);
            tags.extend(toolcall::XML_TAGS);
        }
        Some(Family::Llama3) => tags.push(PYTHON_TAG),
        Some(Family::Mistral) => {
            tags.extend([
                MISTRAL_CALLS,
                toolcall::MISTRAL_ARGS,
                toolcall::MISTRAL_CALL_ID,
            ]);
            if reasoning {
                tags.extend([MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE]);
            }
        }
        Some(f) => return crate::formats::family_tags(f, reasoning),
    }
    if reasoning {
        tags.extend([THINK_OPEN, THINK_CLOSE]);
    }
    tags.extend(crate::END_MARKERS);
    tags
}

/// One-shot form of [`OutputParser`]: equal to the coalesced streamed result
/// for every chunking.
pub fn parse_output(
    text: &str,
    family: Option<Family>,
    reasoning: bool,
    starts_in_reasoning: bool,
) -> Result<Vec<Segment>, TextError> {
    let mut p = OutputParser::new(family, reasoning, starts_in_reasoning)?;
    let mut segs = p.push(text);
    p.flush_into(&mut segs);
    Ok(segs)
}
