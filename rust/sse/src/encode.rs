//! SSE frame encoder.

use crate::SseError;

/// The Anthropic keep-alive frame, sent while a long prefill runs.
pub const PING_FRAME: &[u8] = b"event: ping\ndata: {\"type\": \"ping\"}\n\n";

/// Optional fields of an event frame beyond the name and data.
#[derive(Clone, Copy, Debug, Default)]
pub struct EventFields<'a> {
    /// `id:` line: becomes the stream's last event id on the client.
    pub id: Option<&'a str>,
    /// `retry:` line: the client's reconnection delay in milliseconds.
    pub retry: Option<u64>,
}

/// Calls `f` on each line of `text`, split at CRLF, CR or LF (WHATWG rules).
/// An empty text is one empty line; a trailing line break adds an empty line.
fn for_each_line(text: &str, mut f: impl FnMut(&str)) {
    let b = text.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\n' => {
                f(&text[start..i]);
                start = i + 1;
            }
            b'\r' => {
                f(&text[start..i]);
                if b.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    f(&text[start..]);
}

/// Appends one event frame to `out`.
///
/// ```text
///   event: NAME          (when a name is given)
///   id: ID               (optional)
///   retry: MS            (optional)
///   data: line 1         (one line per line of `data`; CRLF and CR become LF
///   data: line 2          once decoded)
///   <blank line>
/// ```
/// `out` is unchanged on error.
pub fn encode_event_into(
    out: &mut Vec<u8>,
    event: Option<&str>,
    data: &str,
    fields: EventFields<'_>,
) -> Result<(), SseError> {
    if let Some(name) = event {
        if name.is_empty() || name.contains(['\r', '\n']) {
            return Err(SseError::InvalidEventName(name.to_owned()));
        }
    }
    if let Some(id) = fields.id {
        if id.contains(['\r', '\n', '\0']) {
            return Err(SseError::InvalidId(id.to_owned()));
        }
    }
    out.reserve(data.len() + event.map_or(0, str::len) + 16);
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    if let Some(id) = fields.id {
        out.extend_from_slice(b"id: ");
        out.extend_from_slice(id.as_bytes());
        out.push(b'\n');
    }
    if let Some(ms) = fields.retry {
        out.extend_from_slice(format!("retry: {ms}\n").as_bytes());
    }
    for_each_line(data, |line| {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    });
    out.push(b'\n');
    Ok(())
}

/// One event frame with a name (or none) and data.
pub fn encode_event(event: Option<&str>, data: &str) -> Result<Vec<u8>, SseError> {
    let mut out = Vec::new();
    encode_event_into(&mut out, event, data, EventFields::default())?;
    Ok(out)
}

/// Appends a comment frame: each line of `text` as `: line`, then a blank line.
/// Clients ignore comments; they keep idle connections and proxies alive.
pub fn encode_comment_into(out: &mut Vec<u8>, text: &str) {
    for_each_line(text, |line| {
        out.push(b':');
        if !line.is_empty() {
            out.push(b' ');
            out.extend_from_slice(line.as_bytes());
        }
        out.push(b'\n');
    });
    out.push(b'\n');
}

/// A comment frame (see [`encode_comment_into`]).
///
/// ```
/// assert_eq!(cairn_sse::encode_comment("keep-alive"), b": keep-alive\n\n");
/// ```
pub fn encode_comment(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    encode_comment_into(&mut out, text);
    out
}
