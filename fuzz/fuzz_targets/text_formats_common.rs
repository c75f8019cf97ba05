// Shared harness for the `text_format_*` fuzz targets, one per family of
// `cairn_text::formats` (included with `#[path]`). For arbitrary text built
// from the family's syntax: no panics, any chunking equals the one-shot
// parse (and cut by max_tokens, any chunking equals the one-shot cut),
// segments are well formed; and a well-formed call whose argument is
// arbitrary text (tag text, quotes, escapes) parses to exactly that call,
// with nothing else around it, under any chunking.
use arbitrary::Arbitrary;
use cairn_text::{parse_output, Family, OutputParser, Segment, ToolSchemas};
use serde_json::Value;

#[path = "text_common.rs"]
#[allow(dead_code)]
mod base;
#[path = "../../rust/text/tests/common/calls.rs"]
mod calls;

use base::{chunk, Piece};

#[derive(Arbitrary, Debug)]
pub struct Input {
    pieces: Vec<Piece>,
    reasoning: bool,
    starts_in_reasoning: bool,
    cuts: Vec<u8>,
    /// The argument of the well-formed call.
    arg: Vec<Piece>,
}

const COMMON: &[&str] = &[
    "<think>", "</think>", "<|im_end|>", "<|endoftext|>", "<", ">", "|", "{", "}", "[", "]",
    "(", ")", "\"", "'", "\\", "=", ",", ":", "\n", " ", "é", "🙂", "｜", r#"{"p": 1}"#,
];

fn fragments(family: Family) -> &'static [&'static str] {
    match family {
        Family::Harmony => &[
            "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary",
            " to=functions.f", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>",
            "<|return|>", "<|chan",
        ],
        Family::Glm45 => &[
            "<tool_call>", "</tool_call>", "f\n", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<|user|>",
        ],
        Family::DeepSeekV3 => &[
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "f\n", "```json\n", "```",
            "<｜end▁of▁sentence｜>", "<｜tool▁",
        ],
        Family::KimiK2 => &[
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>",
        ],
        Family::Gemma4 => &[
            "<|channel>", "thought\n", "<channel|>", "<|tool_call>", "call:f{", "p:", "<|\"|>",
            "<tool_call|>", "<turn|>", "true",
        ],
        Family::MiniMaxM2 => &[
            "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=\"f\">", "</invoke>",
            "<parameter name=\"p\">", "</parameter>",
        ],
        Family::Pythonic => &[
            "[f(p=1)]", "f(", "p=", "'x'", "True", "<|python_start|>", "<|python_end|>", "<|eot|>",
        ],
        _ => &[],
    }
}

fn build(family: Family, pieces: &[Piece]) -> String {
    let own = fragments(family);
    base::join(pieces, |i| {
        let i = i as usize % (own.len() + COMMON.len());
        if i < own.len() { own[i] } else { COMMON[i - own.len()] }
    })
}

fn run_chunks(p: &mut OutputParser, chunks: &[String]) -> Vec<Segment> {
    let mut got = Vec::new();
    for c in chunks {
        got.extend(p.push(c));
    }
    got.extend(p.flush());
    OutputParser::coalesce(got)
}

/// Like `run_chunks`, for a stream cut by max_tokens (`flush_cut`).
fn cut_chunks(p: &mut OutputParser, chunks: &[String]) -> Vec<Segment> {
    let mut got: Vec<Segment> = chunks.iter().flat_map(|c| p.push(c)).collect();
    got.extend(p.flush_cut());
    OutputParser::coalesce(got)
}

pub fn run(family: Family, inp: Input) {
    let text = build(family, &inp.pieces);
    let sir = inp.reasoning && inp.starts_in_reasoning;
    let want = parse_output(&text, Some(family), inp.reasoning, sir).unwrap();
    let mut p = OutputParser::new(Some(family), inp.reasoning, sir).unwrap();
    assert_eq!(run_chunks(&mut p, &chunk(&text, &inp.cuts)), want, "{text:?}");
    let cut = cut_chunks(&mut p, std::slice::from_ref(&text));
    assert_eq!(cut_chunks(&mut p, &chunk(&text, &inp.cuts)), cut, "cut {text:?}");
    for s in &want {
        match s {
            Segment::Text(t) | Segment::Reasoning(t) => assert!(!t.is_empty()),
            Segment::ToolCall(c) => {
                assert!(!c.name.is_empty());
                let v: Value = serde_json::from_str(&c.arguments).unwrap();
                assert!(v.is_object());
            }
        }
    }

    let arg = build(family, &inp.arg);
    if let Some((text, want)) = calls::well_formed(family, false, &arg) {
        let mut p = OutputParser::new(Some(family), inp.reasoning, false).unwrap();
        let schemas = r#"{"f": {"properties": {"p": {"type": "string"}}}}"#;
        p.set_tool_schemas(ToolSchemas::from_json(schemas).unwrap());
        assert_eq!(run_chunks(&mut p, &chunk(&text, &inp.cuts)), want, "{text:?}");
    }
}
