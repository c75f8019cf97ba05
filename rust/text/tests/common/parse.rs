//! Helpers for the output-parser tests: segment builders and a checker that
//! streams an input under several chunkings against the one-shot parse.
use cairn_text::{parse_output, Family, OutputParser, Segment, ToolCall};

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
