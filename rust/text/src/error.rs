//! Errors reported when building a scanner or parser.
use std::fmt;

/// A configuration the text core refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextError {
    /// A stop sequence was the empty string (it would match everywhere).
    EmptyStop { index: usize },
    /// The tool-call family name is not one of [`crate::Family::NAMES`].
    UnknownFamily(String),
    /// `starts_in_reasoning` was set while reasoning parsing is off.
    ReasoningOff,
    /// The stop automaton could not be built (e.g. too many states).
    Build(String),
    /// The tool schemas were not JSON of a shape [`crate::ToolSchemas`] reads.
    ToolSchemas(String),
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TextError::EmptyStop { index } => {
                write!(f, "stop sequence at index {index} is empty")
            }
            TextError::UnknownFamily(name) => write!(
                f,
                "unknown tool-call family {name:?}; expected one of {}",
                crate::Family::NAMES.join(", ")
            ),
            TextError::ReasoningOff => {
                write!(f, "starts_in_reasoning=True needs reasoning=True")
            }
            TextError::Build(msg) => write!(f, "cannot build stop scanner: {msg}"),
            TextError::ToolSchemas(msg) => write!(f, "cannot read tool schemas: {msg}"),
        }
    }
}

impl std::error::Error for TextError {}
