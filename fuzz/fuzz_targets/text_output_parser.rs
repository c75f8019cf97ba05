//! OutputParser: no panics, any chunking equals the one-shot parse (and, for
//! a stream cut by max_tokens, the one-shot cut), markers never reach a
//! segment, and (for tag families) nothing but tags and whitespace after
//! blocks is lost. Also: a well-formed call whose argument
//! is arbitrary text (tags, quotes and escapes included) comes back as
//! exactly that call in every family, under any chunking.
#![no_main]
use arbitrary::Arbitrary;
use cairn_text::{parse_output, Family, OutputParser, Segment, END_MARKERS};
use libfuzzer_sys::fuzz_target;

#[path = "../../rust/text/tests/common/calls.rs"]
mod calls;
#[path = "text_common.rs"]
mod common;

#[derive(Arbitrary, Debug)]
struct Input {
    pieces: Vec<common::Piece>,
    family: u8,
    reasoning: bool,
    starts_in_reasoning: bool,
    cuts: Vec<u8>,
    /// The argument of the well-formed call, and which shape it takes.
    arg: Vec<common::Piece>,
    form: u8,
}

const TAGS: [&str; 4] = ["<think>", "</think>", "<tool_call>", "</tool_call>"];

/// Removes every marker once, in list order.
fn strip_markers(s: &str) -> String {
    END_MARKERS
        .iter()
        .fold(s.to_owned(), |s, m| s.replace(m, ""))
}

/// Tags and markers removed until none is left, whitespace dropped.
fn squash(s: &str) -> String {
    let mut s = s.to_owned();
    loop {
        let t = TAGS.iter().fold(strip_markers(&s), |s, t| s.replace(t, ""));
        if t == s {
            return s.chars().filter(|c| !c.is_whitespace()).collect();
        }
        s = t;
    }
}

fuzz_target!(|inp: Input| {
    let text = common::build(&inp.pieces);
    let family = common::family(inp.family);
    let sir = inp.reasoning && inp.starts_in_reasoning;
    let want = parse_output(&text, family, inp.reasoning, sir).unwrap();

    let mut p = OutputParser::new(family, inp.reasoning, sir).unwrap();
    let mut got = Vec::new();
    for c in common::chunk(&text, &inp.cuts) {
        got.extend(p.push(&c));
    }
    got.extend(p.flush());
    assert_eq!(OutputParser::coalesce(got), want);
    // Cut by max_tokens (`flush_cut`): any chunking equals the one-shot cut.
    let mut cut = p.push(&text);
    cut.extend(p.flush_cut());
    let chunks = common::chunk(&text, &inp.cuts);
    let mut got: Vec<Segment> = chunks.iter().flat_map(|c| p.push(c)).collect();
    got.extend(p.flush_cut());
    assert_eq!(OutputParser::coalesce(got), OutputParser::coalesce(cut));

    // A marker the model spelled around another one (`<|im_<|eot_id|>end|>`)
    // appears once the inner one is dropped; only plain inputs must be clean.
    let plain = !END_MARKERS.iter().any(|m| strip_markers(&text).contains(m));
    let mut all = String::new();
    for s in &want {
        match s {
            Segment::Text(t) | Segment::Reasoning(t) => {
                assert!(!t.is_empty());
                for m in END_MARKERS.iter().filter(|_| plain) {
                    assert!(!t.contains(m), "marker {m} in {t:?}");
                }
                all.push_str(t);
            }
            Segment::ToolCall(c) => {
                assert!(!c.name.is_empty());
                assert!(c.arguments.starts_with('{') && c.arguments.ends_with('}'));
                all.push_str(&c.raw);
            }
        }
    }
    if inp.reasoning
        && matches!(
            family,
            None | Some(Family::Hermes) | Some(Family::Qwen3Coder)
        )
    {
        assert_eq!(squash(&all), squash(&text));
    }

    let family = family.unwrap_or(Family::Hermes);
    if let Some((text, want)) = calls::well_formed(family, inp.form % 2 == 1, &common::build(&inp.arg)) {
        let mut p = OutputParser::new(Some(family), inp.reasoning, false).unwrap();
        let mut got = Vec::new();
        for c in common::chunk(&text, &inp.cuts) {
            got.extend(p.push(&c));
        }
        got.extend(p.flush());
        assert_eq!(OutputParser::coalesce(got), want, "{text:?}");
    }
});
