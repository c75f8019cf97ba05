//! cairn-text: the streaming text core between the model and the wire
//! (docs/design.md §3). Pure Rust, no pyo3.
//!
//! - [`StopScanner`]: many stop sequences at once, earliest completed match
//!   wins, trailing partial matches held back.
//! - [`OutputParser`]: splits model text into visible text, reasoning
//!   (`<think>` or the family's own channels) and tool calls for the
//!   families in [`Family`].
//! - [`TextPipeline`]: both, in the order the engine needs them.
//!
//! Every type gives the same result for any chunking of the same input.
//!
//! ```
//! use cairn_text::{Family, OutputParser, Segment, TextPipeline};
//!
//! let mut p = TextPipeline::new(&["###"], Some(Family::Hermes), true, false).unwrap();
//! let (mut segs, stop) = p.push("<think>plan</think>Hi ##");
//! assert_eq!(stop, None);
//! let (more, stop) = p.push("# not shown");
//! segs.extend(more);
//! assert_eq!(stop, Some(0));
//! assert_eq!(
//!     OutputParser::coalesce(segs),
//!     vec![Segment::Reasoning("plan".into()), Segment::Text("Hi ".into())]
//! );
//! ```

mod error;
mod formats;
mod json_scan;
mod parser;
mod pipeline;
mod schema;
mod stop;
mod tags;
mod toolcall;

pub mod reference;

pub use error::TextError;
pub use parser::{parse_output, parser_tags, OutputParser, Segment, ToolCall};
pub use pipeline::TextPipeline;
pub use schema::ToolSchemas;
pub use stop::StopScanner;
pub use tags::{Family, END_MARKERS};
