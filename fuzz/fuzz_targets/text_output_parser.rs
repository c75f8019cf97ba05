//! OutputParser: no panics, any chunking equals the one-shot parse (and, for
//! a stream cut by max_tokens, the one-shot cut), markers never reach a
//! segment, and (for tag families) nothing but tags and whitespace after
//! blocks is lost. Also: a well-formed call whose argument
//! is arbitrary text (tags, quotes and escapes included) comes back as
//! exactly that call in every family, under any chunking.
#![no_main]
use arbitrary::Arbitrary;
use cairn_text::{parse_output, Family, OutputParser, Segment, ToolCall, END_MARKERS};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

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

/// Whether a Qwen3-Coder value holds text its closing rule reads as
/// structure (`</parameter>` then `<parameter=`, or `</function>` then
/// `</tool_call>`, whitespace between): such a value cannot round-trip.
fn xml_ambiguous(v: &str) -> bool {
    let followed = |tag: &str, next: &str| {
        v.match_indices(tag)
            .any(|(i, _)| v[i + tag.len()..].trim_start().starts_with(next))
    };
    followed("</parameter>", "<parameter=") || followed("</function>", "</tool_call>")
}

fn call(args: &str, raw: &str) -> Segment {
    Segment::ToolCall(ToolCall {
        name: "f".into(),
        arguments: args.into(),
        raw: raw.into(),
    })
}

/// One call to `f` with argument `p` = `s` in the family's syntax: the model
/// text and the segments it must parse to. `None` when `s` cannot be sent.
fn well_formed(family: Family, form: u8, s: &str) -> Option<(String, Vec<Segment>)> {
    // Markers are dropped even inside strings, so the call would differ.
    if END_MARKERS.iter().any(|m| s.contains(m)) {
        return None;
    }
    let args = json!({ "p": s }).to_string();
    let obj = |key: &str| json!({"name": "f", key: {"p": s}}).to_string();
    let text = |t: &str| Segment::Text(t.into());
    Some(match (family, form % 2 == 1) {
        (Family::Hermes, _) | (Family::Qwen3Coder, false) => {
            let body = obj("arguments");
            let input = format!("Hi <tool_call>{body}</tool_call> bye");
            (input, vec![text("Hi "), call(&args, &body), text("bye")])
        }
        (Family::Qwen3Coder, true) => {
            if xml_ambiguous(s) {
                return None;
            }
            let v = serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s));
            let args = json!({ "p": v }).to_string();
            let body = format!("\n<function=f>\n<parameter=p>\n{s}\n</parameter>\n</function>\n");
            let input = format!("Hi <tool_call>{body}</tool_call> bye");
            (input, vec![text("Hi "), call(&args, &body), text("bye")])
        }
        (Family::Llama3, false) => {
            let body = obj("parameters");
            (
                format!("<|python_tag|>{body}<|eom_id|>"),
                vec![call(&args, &body)],
            )
        }
        (Family::Llama3, true) => {
            let body = obj("parameters");
            (body.clone(), vec![call(&args, &body)])
        }
        (Family::Mistral, false) => {
            let body = format!("[{}]", obj("arguments"));
            let input = format!("Hi [TOOL_CALLS]{body}");
            (input, vec![text("Hi "), call(&args, &body)])
        }
        (Family::Mistral, true) => {
            let body = format!("f[ARGS]{}", json!({ "p": s }));
            let input = format!("Hi [TOOL_CALLS]{body}");
            (input, vec![text("Hi "), call(&args, &body)])
        }
        // The other families have their own fuzz targets and tests.
        _ => return None,
    })
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
    if let Some((text, want)) = well_formed(family, inp.form, &common::build(&inp.arg)) {
        let mut p = OutputParser::new(Some(family), inp.reasoning, false).unwrap();
        let mut got = Vec::new();
        for c in common::chunk(&text, &inp.cuts) {
            got.extend(p.push(&c));
        }
        got.extend(p.flush());
        assert_eq!(OutputParser::coalesce(got), want, "{text:?}");
    }
});
