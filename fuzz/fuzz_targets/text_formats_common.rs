// Shared harness for the `text_format_*` fuzz targets, one per family of
// `cairn_text::formats` (included with `#[path]`). For arbitrary text built
// from the family's syntax: no panics, any chunking equals the one-shot
// parse (and cut by max_tokens, any chunking equals the one-shot cut),
// segments are well formed; and a well-formed call whose argument is
// arbitrary text (tag text, quotes, escapes) parses to exactly that call,
// with nothing else around it, under any chunking.
use arbitrary::Arbitrary;
use cairn_text::{parse_output, Family, OutputParser, Segment, ToolCall, ToolSchemas, END_MARKERS};
use serde_json::{json, Value};

#[derive(Arbitrary, Debug)]
pub enum Piece {
    Frag(u8),
    Str(String),
}

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
    let mut s = String::new();
    for p in pieces.iter().take(64) {
        match p {
            Piece::Frag(i) => {
                let i = *i as usize % (own.len() + COMMON.len());
                s.push_str(if i < own.len() { own[i] } else { COMMON[i - own.len()] });
            }
            Piece::Str(t) => s.push_str(t),
        }
    }
    s
}

/// Cuts `s` into chunks of 1..=8 characters, sizes taken from `cuts`.
fn chunk(s: &str, cuts: &[u8]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut k) = (0, 0);
    while i < chars.len() {
        let n = 1 + cuts.get(k).map_or(usize::MAX - 1, |c| (*c % 8) as usize);
        let j = i.saturating_add(n).min(chars.len());
        out.push(chars[i..j].iter().collect());
        i = j;
        k += 1;
    }
    out
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

fn call(args: &str, raw: &str) -> Segment {
    Segment::ToolCall(ToolCall {
        name: "f".into(),
        arguments: args.into(),
        raw: raw.into(),
    })
}

/// `s` as a Python string literal.
fn python_str(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// A call to `f` with argument `p` = `s` in `family`'s syntax and the
/// segments it must parse to; `None` where `s` cannot be written there.
fn well_formed(family: Family, s: &str) -> Option<(String, Vec<Segment>)> {
    let has = |tags: &[&str]| tags.iter().any(|m| s.contains(m));
    if has(END_MARKERS) {
        return None;
    }
    let args = json!({ "p": s }).to_string();
    let t = |x: &str| Segment::Text(x.into());
    Some(match family {
        Family::Harmony => {
            if has(&["<|call|>", "<|end|>", "<|channel|>", "<|start|>", "<|return|>", "<|message|>", "<|constrain|>"]) {
                return None;
            }
            let input = format!("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|><|start|>assistant<|channel|>final<|message|>bye");
            (input, vec![call(&args, &args), t("bye")])
        }
        Family::Glm45 => {
            if has(&["</arg_value>", "<|user|>", "<|assistant|>", "<|observation|>", "<|system|>"]) {
                return None;
            }
            let body = format!("f\n<arg_key>p</arg_key>\n<arg_value>{s}</arg_value>\n");
            (format!("Hi <tool_call>{body}</tool_call> bye"), vec![t("Hi "), call(&args, &body), t("bye")])
        }
        Family::DeepSeekV3 => {
            if has(&["<｜tool▁calls▁end｜>", "<｜tool▁call▁end｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜Assistant｜>", "<｜User｜>"]) {
                return None;
            }
            let c = format!("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{args}<｜tool▁call▁end｜>");
            (format!("Hi <｜tool▁calls▁begin｜>{c}<｜tool▁calls▁end｜> bye"), vec![t("Hi "), call(&args, &c), t("bye")])
        }
        Family::KimiK2 => {
            if has(&["<|tool_calls_section_end|>", "<|tool_call_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|tool_call_section_end|>"]) {
                return None;
            }
            let c = format!("<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{args}<|tool_call_end|>");
            (format!("Hi <|tool_calls_section_begin|>{c}<|tool_calls_section_end|> bye"), vec![t("Hi "), call(&args, &c), t("bye")])
        }
        Family::Gemma4 => {
            if has(&["<|\"|>", "<|turn>", "<turn|>", "<|tool_response>", "<tool_response|>", "<eos>", "<bos>", "<|think|>"]) {
                return None;
            }
            let body = format!("call:f{{p:<|\"|>{s}<|\"|>}}");
            (format!("Hi <|tool_call>{body}<tool_call|> bye"), vec![t("Hi "), call(&args, &body), t("bye")])
        }
        Family::MiniMaxM2 => {
            // `</invoke>` then `</minimax:tool_call>` (whitespace between)
            // in a value reads as the section's end.
            let ends = s.match_indices("</invoke>").any(|(i, _)| {
                s[i + 9..].trim_start().starts_with("</minimax:tool_call>")
            });
            if ends || has(&["</parameter>", "]~b]", "]~!b[", "[e~["]) {
                return None;
            }
            let body = format!("\n<invoke name=\"f\">\n<parameter name=\"p\">\n{s}\n</parameter>\n</invoke>\n");
            (format!("Hi <minimax:tool_call>{body}</minimax:tool_call> bye"), vec![t("Hi "), call(&args, &body), t("bye")])
        }
        Family::Pythonic => {
            // Markers inside a bare list are dropped, so `<` may not survive.
            if s.contains('<') {
                return None;
            }
            let body = format!("[f(p={})]", python_str(s));
            (format!("{body} bye"), vec![call(&args, &body), t("bye")])
        }
        _ => return None,
    })
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
    if let Some((text, want)) = well_formed(family, &arg) {
        let mut p = OutputParser::new(Some(family), inp.reasoning, false).unwrap();
        let schemas = r#"{"f": {"properties": {"p": {"type": "string"}}}}"#;
        p.set_tool_schemas(ToolSchemas::from_json(schemas).unwrap());
        assert_eq!(run_chunks(&mut p, &chunk(&text, &inp.cuts)), want, "{text:?}");
    }
}
