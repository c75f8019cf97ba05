//! cairn-sse: Server-Sent Events framing (docs/design.md §3). Pure Rust.
//!
//! The encoder writes frames that every WHATWG-conforming client decodes to
//! the same event: an `event:` line whenever a name is given (the Anthropic
//! SDK drops events without one), data split into one `data:` line per line
//! of text, optional `id:`/`retry:`, comment and ping frames. The decoder
//! implements the WHATWG event-stream interpretation incrementally, so bytes
//! may arrive in any chunking.
//!
//! ```
//! use cairn_sse::{encode_event, Decoder};
//! let frame = encode_event(Some("content_block_delta"), "line 1\nline 2").unwrap();
//! assert_eq!(frame, b"event: content_block_delta\ndata: line 1\ndata: line 2\n\n");
//! let mut dec = Decoder::new();
//! let mut events = Vec::new();
//! for b in frame.chunks(3) {
//!     dec.feed(b, &mut events).unwrap();
//! }
//! assert_eq!(events[0].event.as_deref(), Some("content_block_delta"));
//! assert_eq!(events[0].data, "line 1\nline 2");
//! ```

mod decode;
mod encode;

pub use decode::{Decoder, Event};
pub use encode::{
    encode_comment, encode_comment_into, encode_event, encode_event_into, EventFields, PING_FRAME,
};

/// Why a frame could not be encoded, or a stream could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseError {
    /// An event name that is empty or contains CR or LF.
    InvalidEventName(String),
    /// An id that contains CR, LF or NUL (clients would drop or split it).
    InvalidId(String),
    /// The decoder's line or event buffer grew past its configured limit.
    EventTooLarge { limit: usize },
}

impl std::fmt::Display for SseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SseError::InvalidEventName(n) => {
                write!(
                    f,
                    "SSE event name must be non-empty without CR or LF, got {n:?}"
                )
            }
            SseError::InvalidId(i) => write!(f, "SSE id must not contain CR, LF or NUL, got {i:?}"),
            SseError::EventTooLarge { limit } => {
                write!(f, "SSE event exceeds the decoder limit of {limit} bytes")
            }
        }
    }
}

impl std::error::Error for SseError {}
