//! Helpers for the output-parser tests: segment builders and a checker that
//! streams an input under several chunkings against the one-shot parse.
use cairn_text::{parse_output, Family, OutputParser, Segment, TextPipeline, ToolCall};

use super::chunks_of;

pub fn text(s: &str) -> Segment {
    Segment::Text(s.into())
}

pub fn reasoning(s: &str) -> Segment {
    Segment::Reasoning(s.into())
}

pub fn call(name: &str, args: &str) -> (String, String) {
    (name.into(), args.into())
}

pub fn tc(name: &str, args: &str, raw: &str) -> Segment {
    Segment::ToolCall(ToolCall {
        name: name.into(),
        arguments: args.into(),
        raw: raw.into(),
    })
}

/// Streams `chunks`, coalesces, and checks it equals the one-shot result.
pub fn stream(
    input: &str,
    chunks: &[String],
    family: Option<Family>,
    reasoning: bool,
    sir: bool,
) -> Vec<Segment> {
    let mut p = OutputParser::new(family, reasoning, sir).unwrap();
    let mut segs = Vec::new();
    for c in chunks {
        segs.extend(p.push(c));
    }
    segs.extend(p.flush());
    let segs = OutputParser::coalesce(segs);
    assert_eq!(
        segs,
        parse_output(input, family, reasoning, sir).unwrap(),
        "input {input:?} chunks {chunks:?}"
    );
    segs
}

/// Checks `input` parses to `want` for chunk sizes 1, 2, 3, 5, 8 and whole.
pub fn check(input: &str, family: Option<Family>, reasoning: bool, sir: bool, want: &[Segment]) {
    for n in [1, 2, 3, 5, 8, usize::MAX] {
        let chunks = if n == usize::MAX {
            vec![input.to_owned()]
        } else {
            chunks_of(input, n)
        };
        assert_eq!(
            stream(input, &chunks, family, reasoning, sir),
            want,
            "chunk size {n}"
        );
    }
}

/// The one-shot parse of `input` for `family`, reasoning off.
pub fn parsed(input: &str, family: Family) -> Vec<Segment> {
    parse_output(input, Some(family), false, false).unwrap()
}

pub fn calls_of(segs: &[Segment]) -> Vec<(String, String)> {
    segs.iter()
        .filter_map(|s| match s {
            Segment::ToolCall(ToolCall {
                name, arguments, ..
            }) => Some((name.clone(), arguments.clone())),
            _ => None,
        })
        .collect()
}

/// Streams `chunks` and ends the stream with `flush_cut` (`cut`, generation
/// hit `max_tokens`) or `flush`; coalesced.
pub fn run_end(
    chunks: &[String],
    family: Option<Family>,
    reasoning: bool,
    sir: bool,
    cut: bool,
) -> Vec<Segment> {
    let mut p = OutputParser::new(family, reasoning, sir).unwrap();
    let mut segs = Vec::new();
    for c in chunks {
        p.push_into(c, &mut segs);
    }
    if cut {
        p.flush_cut_into(&mut segs);
    } else {
        p.flush_into(&mut segs);
    }
    OutputParser::coalesce(segs)
}

/// `input` in one piece, flushed (the stream ended).
pub fn flushed(input: &str, family: Option<Family>, reasoning: bool, sir: bool) -> Vec<Segment> {
    run_end(&[input.to_owned()], family, reasoning, sir, false)
}

/// Streams `chunks` through a [`TextPipeline`] (reasoning on) and ends it
/// with `flush_cut` (`cut`) or `flush`: the coalesced segments and the stop.
pub fn pipeline_end(
    stops: &[&str],
    chunks: &[String],
    family: Option<Family>,
    cut: bool,
) -> (Vec<Segment>, Option<usize>) {
    let mut p = TextPipeline::new(stops, family, true, false).unwrap();
    let (mut segs, mut stop) = (Vec::new(), None);
    for c in chunks {
        let (s, m) = p.push(c);
        segs.extend(s);
        stop = stop.or(m);
    }
    segs.extend(p.finish(cut));
    (OutputParser::coalesce(segs), stop)
}
