//! Stop scan then output parsing, as the engine runs them once per token.
use crate::{Family, OutputParser, Segment, StopScanner, TextError, ToolSchemas};

/// [`StopScanner`] over the raw model text, then [`OutputParser`] over what
/// the scanner released. After a stop matches, the parser is flushed and
/// everything later (tool calls included) is dropped until [`flush`].
///
/// [`flush`]: TextPipeline::flush
#[derive(Debug, Clone)]
pub struct TextPipeline {
    scanner: StopScanner,
    parser: OutputParser,
    scratch: String,
    done: bool,
}

impl TextPipeline {
    /// A pipeline with these stop sequences and parser settings.
    pub fn new<S: AsRef<str>>(
        stops: &[S],
        family: Option<Family>,
        reasoning: bool,
        starts_in_reasoning: bool,
    ) -> Result<Self, TextError> {
        Ok(TextPipeline {
            scanner: StopScanner::new(stops)?,
            parser: OutputParser::new(family, reasoning, starts_in_reasoning)?,
            scratch: String::new(),
            done: false,
        })
    }

    /// Sets the request's tool schemas ([`OutputParser::set_tool_schemas`]).
    pub fn set_tool_schemas(&mut self, schemas: ToolSchemas) {
        self.parser.set_tool_schemas(schemas);
    }

    /// The stop scanner (for its stop list).
    pub fn scanner(&self) -> &StopScanner {
        &self.scanner
    }

    /// The output parser (for its settings).
    pub fn parser(&self) -> &OutputParser {
        &self.parser
    }

    /// Feeds one decoded chunk; returns the finished segments and the index
    /// of the stop that matched in this call, if any.
    pub fn push(&mut self, text: &str) -> (Vec<Segment>, Option<usize>) {
        let mut segs = Vec::new();
        if self.done {
            return (segs, None);
        }
        self.scratch.clear();
        let m = self.scanner.push_into(text, &mut self.scratch);
        self.parser.push_into(&self.scratch, &mut segs);
        if m.is_some() {
            self.parser.flush_into(&mut segs);
            self.done = true;
        }
        (segs, m)
    }

    /// Ends the stream (the model finished) and resets the pipeline for a
    /// new one; see [`OutputParser::flush`].
    pub fn flush(&mut self) -> Vec<Segment> {
        self.finish(false)
    }

    /// Ends a stream cut by `max_tokens` and resets the pipeline: a held
    /// partial stop match is released as text as in [`flush`], but a tool
    /// call still open is dropped; see [`OutputParser::flush_cut`].
    ///
    /// [`flush`]: TextPipeline::flush
    pub fn flush_cut(&mut self) -> Vec<Segment> {
        self.finish(true)
    }

    /// [`flush_cut`] when `cut`, else [`flush`].
    ///
    /// [`flush`]: TextPipeline::flush
    /// [`flush_cut`]: TextPipeline::flush_cut
    pub fn finish(&mut self, cut: bool) -> Vec<Segment> {
        let mut segs = Vec::new();
        if !self.done {
            self.scratch.clear();
            self.scanner.flush_into(&mut self.scratch);
            self.parser.push_into(&self.scratch, &mut segs);
            if cut {
                self.parser.flush_cut_into(&mut segs);
            } else {
                self.parser.flush_into(&mut segs);
            }
        }
        self.reset();
        segs
    }

    /// Forgets all state: a fresh stream with the same settings.
    pub fn reset(&mut self) {
        self.scanner.reset();
        self.parser.reset();
        self.done = false;
    }
}
