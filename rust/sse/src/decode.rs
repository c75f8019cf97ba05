//! Incremental SSE decoder following the WHATWG event-stream interpretation
//! (<https://html.spec.whatwg.org/multipage/server-sent-events.html>).

use crate::SseError;

/// One dispatched event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// The `event:` field; `None` means the default type ("message").
    pub event: Option<String>,
    /// The data lines joined with LF.
    pub data: String,
    /// The stream's last event id at dispatch time (it persists across events).
    pub id: Option<String>,
    /// A `retry:` value seen since the previous dispatch.
    pub retry: Option<u64>,
}

/// Turns bytes, in any chunking, into events.
///
/// Lines end at CRLF, CR or LF (a CR at the end of one chunk and an LF at the
/// start of the next are one line break). A leading UTF-8 BOM is dropped and
/// invalid UTF-8 becomes U+FFFD. A blank line dispatches the event if any
/// `data:` line was seen; an event still incomplete at the end of the stream
/// is discarded, as the specification says ([`Decoder::has_partial`] tells).
#[derive(Clone, Debug)]
pub struct Decoder {
    line: Vec<u8>,
    skip_lf: bool,
    first_line: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    last_id: Option<String>,
    retry: Option<u64>,
    limit: Option<usize>,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new()
    }
}

impl Decoder {
    /// A decoder without size limit.
    pub fn new() -> Self {
        Decoder {
            line: Vec::new(),
            skip_lf: false,
            first_line: true,
            event: None,
            data: String::new(),
            has_data: false,
            last_id: None,
            retry: None,
            limit: None,
        }
    }

    /// A decoder that fails once a line or an event's data passes `limit`
    /// bytes, so a hostile stream cannot grow memory without bound.
    pub fn with_limit(limit: usize) -> Self {
        Decoder {
            limit: Some(limit),
            ..Decoder::new()
        }
    }

    /// True when bytes of an unfinished line or event are buffered.
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data || self.event.is_some() || self.retry.is_some()
    }

    /// The last event id seen so far (it outlives the events that set it).
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }

    /// Ends the stream: any incomplete event is discarded and the decoder is
    /// ready for a new stream. Returns whether something was discarded.
    pub fn finish(&mut self) -> bool {
        let partial = self.has_partial();
        let limit = self.limit;
        *self = Decoder {
            limit,
            ..Decoder::new()
        };
        partial
    }

    /// Feeds one chunk; complete events are appended to `out`.
    ///
    /// On `Err` (only with a limit) the decoder is reset, as after `finish`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        let mut rest = chunk;
        while !rest.is_empty() {
            if self.skip_lf {
                self.skip_lf = false;
                if rest[0] == b'\n' {
                    rest = &rest[1..];
                    continue;
                }
            }
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(p) => {
                    self.line.extend_from_slice(&rest[..p]);
                    self.skip_lf = rest[p] == b'\r';
                    rest = &rest[p + 1..];
                    self.check_limit()?;
                    let line = std::mem::take(&mut self.line);
                    self.process_line(&line, out);
                    // Keep the allocation for the next line.
                    self.line = line;
                    self.line.clear();
                }
                None => {
                    self.line.extend_from_slice(rest);
                    rest = &[];
                    self.check_limit()?;
                }
            }
        }
        Ok(())
    }

    fn check_limit(&mut self) -> Result<(), SseError> {
        if let Some(limit) = self.limit {
            if self.line.len() + self.data.len() > limit {
                self.finish();
                return Err(SseError::EventTooLarge { limit });
            }
        }
        Ok(())
    }

    fn process_line(&mut self, mut line: &[u8], out: &mut Vec<Event>) {
        if self.first_line {
            self.first_line = false;
            line = line.strip_prefix(BOM).unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"event" => self.event = Some(String::from_utf8_lossy(value).into_owned()),
            b"data" => {
                self.data.push_str(&String::from_utf8_lossy(value));
                self.data.push('\n');
                self.has_data = true;
            }
            b"id" if !value.contains(&0) => {
                self.last_id = Some(String::from_utf8_lossy(value).into_owned());
            }
            // Only ASCII digits count; digits beyond u64 are ignored as well.
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                if let Ok(ms) = std::str::from_utf8(value).unwrap_or("").parse() {
                    self.retry = Some(ms);
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, out: &mut Vec<Event>) {
        let event = self.event.take();
        let retry = self.retry.take();
        if !self.has_data {
            return;
        }
        self.has_data = false;
        let mut data = std::mem::take(&mut self.data);
        data.pop(); // the LF after the last data line
        out.push(Event {
            event,
            data,
            id: self.last_id.clone(),
            retry,
        });
    }
}
