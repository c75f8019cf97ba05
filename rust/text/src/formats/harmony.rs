//! gpt-oss harmony: the model writes messages, each a header then content.
//!
//! ```text
//! <|channel|>analysis<|message|>think..<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
//! <|start|>assistant<|channel|>final<|message|>answer<|return|>
//! ```
//!
//! The prompt ends with `<|start|>assistant`, so the stream begins in a
//! header. The recipient (`to=..`) may sit before `<|channel|>` (in the role
//! part) or after the channel name. A message with a recipient is a tool
//! call (`functions.` is dropped from the name; the content is the JSON
//! arguments); otherwise the `analysis` channel is reasoning (always: it is
//! the model's chain of thought, never answer text) and every other channel
//! (`final`, a recipient-less `commentary` preamble) is visible text.
//! Content ends at `<|end|>`, `<|call|>`, `<|return|>`, the next message's
//! `<|start|>` / `<|channel|>`, or the end of the stream (`<|call|>` and
//! `<|return|>` are end-of-generation tokens the engine never hands over).
//!
//! A header is short and made of header words only; when what should be a
//! header turns out to be prose (a model answering without harmony), it is
//! released as text.
use super::{markers, Machine, Out, Tags};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
/// Every tag the parser reads.
pub(crate) const TAGS: &[&str] = &[START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN];

/// Longest header kept before it is taken for prose.
const MAX_HEADER: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tok {
    Start,
    Channel,
    Message,
    Constrain,
    /// `<|end|>`, `<|call|>`, `<|return|>`.
    End,
    Marker,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Collecting a message header (in `header`).
    Header,
    /// Text outside any message (after prose, or an end without a start).
    Plain,
    Reasoning,
    Text,
    /// Collecting a tool call's arguments (in `body`) for `name`.
    Call,
}

#[derive(Debug, Clone)]
pub(crate) struct Harmony {
    /// The prompt opened an analysis message (`..<|channel|>analysis<|message|>`).
    starts_in_reasoning: bool,
    tags: Tags<Tok>,
    state: State,
    header: String,
    /// The header holds a tag (so it is structure, never prose).
    saw_tag: bool,
    name: String,
    body: String,
}

/// The tool a header's words address (`to=functions.f`), if any.
fn recipient<'a>(mut words: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    words
        .find_map(|w| w.strip_prefix("to="))
        .filter(|r| !r.is_empty() && !["assistant", "user", "all"].contains(r))
}

/// Characters of header words: roles, channels, recipients, content types.
fn header_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || " _.-=:/@".contains(c)
}

impl Harmony {
    pub fn new(starts_in_reasoning: bool) -> Self {
        let mut tags = markers(&[], &[END], Tok::Marker);
        tags.extend([
            (START, Tok::Start),
            (CHANNEL, Tok::Channel),
            (MESSAGE, Tok::Message),
            (CONSTRAIN, Tok::Constrain),
            (END, Tok::End),
            (CALL, Tok::End),
            (RETURN, Tok::End),
        ]);
        let mut h = Harmony {
            starts_in_reasoning,
            tags: Tags::new(tags),
            state: State::Header,
            header: String::new(),
            saw_tag: false,
            name: String::new(),
            body: String::new(),
        };
        h.reset();
        h
    }

    /// Leaves the header: prose is released, structure dropped.
    fn drop_header(&mut self, out: &mut Out) {
        if !self.saw_tag {
            out.text(&self.header);
        }
        self.header.clear();
        self.saw_tag = false;
    }

    fn begin_header(&mut self, out: &mut Out, channel: bool) {
        self.end_message(out);
        if self.state == State::Header {
            self.drop_header(out);
        }
        self.state = State::Header;
        if channel {
            self.header.push_str(CHANNEL);
            self.saw_tag = true;
        }
    }

    /// The header is complete: what its content is.
    fn open_message(&mut self) {
        let h = std::mem::take(&mut self.header);
        self.saw_tag = false;
        let (role, chan) = h.split_once(CHANNEL).unwrap_or((h.as_str(), ""));
        let chan = chan.replace(CONSTRAIN, " ");
        let recipient = recipient(role.split_whitespace().chain(chan.split_whitespace()));
        let channel = chan.split_whitespace().find(|w| !w.starts_with("to="));
        self.state = match (recipient, channel) {
            (Some(r), _) => {
                self.name = r.strip_prefix("functions.").unwrap_or(r).to_owned();
                self.body.clear();
                State::Call
            }
            (None, Some("analysis")) => State::Reasoning,
            _ => State::Text,
        };
    }

    /// Ends the current message's content (a call is parsed here).
    fn end_message(&mut self, out: &mut Out) {
        match self.state {
            State::Call => {
                let body = std::mem::take(&mut self.body);
                let name = std::mem::take(&mut self.name);
                let t = body.trim();
                let args = if t.is_empty() {
                    Some("{}".to_owned())
                } else {
                    match serde_json::from_str::<serde_json::Value>(t) {
                        Ok(v @ serde_json::Value::Object(_)) => Some(v.to_string()),
                        _ => None,
                    }
                };
                match args {
                    Some(a) if super::bodies::name_ok(&name) => out.calls(&body, vec![(name, a)]),
                    _ => out.malformed(&[&body]),
                }
            }
            State::Reasoning | State::Text => {}
            State::Header | State::Plain => return,
        }
        self.state = State::Plain;
    }
}

impl Machine for Harmony {
    type Tok = Tok;

    fn tags(&self) -> &Tags<Tok> {
        &self.tags
    }

    fn content(&mut self, s: &str, out: &mut Out) -> usize {
        match self.state {
            State::Header => {
                let room = MAX_HEADER.saturating_sub(self.header.len());
                let bad = s
                    .char_indices()
                    .find(|&(i, c)| !header_char(c) || i >= room)
                    .map(|(i, _)| i);
                match bad {
                    None if s.len() <= room => {
                        self.header.push_str(s);
                        s.len()
                    }
                    found => {
                        // Prose, not a header: it is text, tags and all.
                        let i = found.unwrap_or(room.min(s.len()));
                        self.header.push_str(&s[..i]);
                        out.malformed(&[&self.header]);
                        self.header.clear();
                        self.saw_tag = false;
                        self.state = State::Plain;
                        i
                    }
                }
            }
            State::Plain | State::Text => {
                out.text(s);
                s.len()
            }
            State::Reasoning => {
                out.reasoning(s);
                s.len()
            }
            State::Call => {
                self.body.push_str(s);
                s.len()
            }
        }
    }

    fn tag(&mut self, t: Tok, out: &mut Out) {
        match (self.state.clone(), t) {
            (_, Tok::Marker) => {}
            (_, Tok::Start) => self.begin_header(out, false),
            (State::Header, Tok::Channel) => {
                self.header.push_str(CHANNEL);
                self.saw_tag = true;
            }
            (_, Tok::Channel) => self.begin_header(out, true),
            (State::Header, Tok::Constrain) => {
                self.header.push_str(CONSTRAIN);
                self.saw_tag = true;
            }
            (State::Header, Tok::Message) => self.open_message(),
            (State::Plain, Tok::Message) => self.state = State::Text,
            (State::Header, Tok::End) => {
                // A message with no content.
                self.drop_header(out);
                self.state = State::Plain;
            }
            (_, Tok::End) => self.end_message(out),
            // `<|message|>` / `<|constrain|>` inside content carry nothing.
            _ => {}
        }
    }

    fn finish(&mut self, out: &mut Out, cut: bool) {
        match self.state {
            // A header that already names a tool opens a call (prose has no
            // `to=` word); one with a tag is structure, dropped anyway.
            State::Header if cut && recipient(self.header.split_whitespace()).is_some() => {
                self.header.clear();
                self.saw_tag = false;
            }
            State::Header => self.drop_header(out),
            // The arguments never ended (`<|call|>` or a next message).
            State::Call if cut => {
                self.body.clear();
                self.name.clear();
                self.state = State::Plain;
            }
            _ => self.end_message(out),
        }
    }

    /// A call's message, or a header that already names a tool: a `<` held
    /// there is not prose that turns the header into text.
    fn in_call(&self) -> bool {
        match self.state {
            State::Call => true,
            State::Header => recipient(self.header.split_whitespace()).is_some(),
            _ => false,
        }
    }

    fn reset(&mut self) {
        self.state = if self.starts_in_reasoning {
            State::Reasoning
        } else {
            State::Header
        };
        self.header.clear();
        self.saw_tag = false;
        self.name.clear();
        self.body.clear();
    }
}
