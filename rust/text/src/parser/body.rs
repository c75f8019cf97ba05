//! Tool-call bodies: collecting them, where each family's body ends, and
//! what becomes of it.
//!
//! A body ends at a tag only outside JSON strings (tracked by [`JsonScan`],
//! which sees every byte pushed to the body), so tag text in an argument
//! never ends a call, under any chunking:
//!
//! - hermes: `<tool_call>` JSON, to `</tool_call>`;
//! - qwen3_coder: `<tool_call><function=..>`, values raw text (no strings),
//!   to the `</tool_call>` that [`tagged_close_ends`] accepts;
//! - llama3: `<|python_tag|>` then JSON, to an end marker; or a reply that
//!   opens with `{`, to the bracket that closes that value;
//! - mistral: `[TOOL_CALLS]` then JSON or `name[ARGS]{..}`, to the next
//!   `[TOOL_CALLS]` or an end marker.
//!
//! Every family also ends at the end of the stream. Inside a string only
//! end-of-turn markers are looked up, and dropped: they never reach a
//! segment (docs/design.md §3), but they do not end the call either.
//!
//! [`JsonScan`]: crate::json_scan::JsonScan
//! [`tagged_close_ends`]: toolcall::tagged_close_ends
use std::mem::take;

use super::{Mode, OutputParser, Segment};
use crate::toolcall::{self, BodyKind};
use crate::{Family, ToolCall};

impl OutputParser {
    /// Whether the body so far ends inside a JSON string, where only
    /// markers are looked up (and dropped) and nothing ends the call.
    pub(super) fn in_json_string(&self) -> bool {
        self.json.in_str()
            && match self.mode {
                // A Qwen3-Coder body is not JSON; its quotes mean nothing.
                Mode::Tagged => toolcall::body_kind(&self.body) == BodyKind::Json,
                Mode::Python | Mode::Mistral | Mode::BareJson => true,
                Mode::Text | Mode::Reasoning => false,
            }
    }

    /// Takes body content from the start of `rest`, stopping before a byte
    /// where a tag may start (any `<`; a `[` outside strings for Mistral) or
    /// after the bracket that closes a top-level JSON value. Returns the bytes
    /// taken and whether such a value closed.
    pub(super) fn body_content(&mut self, rest: &str) -> (usize, bool) {
        let bracket = self.tags().bracket;
        let (n, closed) = self.json.feed_until(rest.as_bytes(), |b, in_str| {
            b == b'<' || (bracket && b == b'[' && !in_str)
        });
        self.body.push_str(&rest[..n]);
        (n, closed)
    }

    /// Appends to the body whatever `s` holds, through the string scanner.
    pub(super) fn body_push(&mut self, s: &str) {
        let mut b = s.as_bytes();
        while !b.is_empty() {
            let (n, _) = self.json.feed_until(b, |_, _| false);
            b = &b[n..];
        }
        self.body.push_str(s);
    }

    pub(super) fn open_body(&mut self, mode: Mode) {
        self.pending.clear();
        self.body.clear();
        self.json.reset();
        self.mode = mode;
    }

    /// The bare JSON value closed: emits it as calls, or returns it when it
    /// is not one, to be read again as text.
    pub(super) fn finish_bare(&mut self) -> Option<String> {
        let body = take(&mut self.body);
        self.mode = Mode::Text;
        match toolcall::parse_llama(&body) {
            Some(calls) => {
                self.emit_calls(calls);
                self.after_call = true;
                None
            }
            None => {
                self.not_bare();
                Some(body)
            }
        }
    }

    /// Parses the collected body; on failure the raw text (with its tags)
    /// becomes visible text so nothing the model wrote is lost.
    pub(super) fn finish_body(
        &mut self,
        open: &str,
        close: &str,
        parse: fn(&str) -> Option<Vec<ToolCall>>,
    ) {
        let body = take(&mut self.body);
        self.mode = Mode::Text;
        match parse(&body) {
            Some(calls) => {
                self.emit_calls(calls);
                self.after_call = self.family == Some(Family::Llama3);
            }
            None => {
                self.lead = false;
                self.trim = false;
                self.detect_bare = false;
                self.after_call = false;
                let raw = [open, &body, close].concat();
                self.emit_text(&raw);
            }
        }
    }

    fn emit_calls(&mut self, calls: Vec<ToolCall>) {
        self.out.extend(calls.into_iter().map(Segment::ToolCall));
        self.block_end();
    }
}
