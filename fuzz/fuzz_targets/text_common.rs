// Shared input shapes for the text fuzz targets (included with `#[path]`).
use arbitrary::Arbitrary;

/// Fragments that make structure likely: tags, markers, whole calls.
const FRAGMENTS: &[&str] = &[
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[THINK]",
    "[/THINK]",
    "<function=f>",
    "<parameter=p>",
    "</parameter>",
    "</function>",
    r#"{"name": "f", "arguments": {"a": 1}}"#,
    r#"{"name": "g", "parameters": {}}"#,
    r#"[{"name": "h", "arguments": {}}]"#,
    // Tag text inside strings and values: it must not end a call.
    r#"{"name": "f", "arguments": {"a": "</tool_call><think>[TOOL_CALLS]<|eom_id|>"}}"#,
    "<function=f><parameter=p>\n</tool_call></parameter></function>\n</parameter></function>",
    "\"",
    "\\",
    "\\\"",
    "<",
    "[",
    "]",
    "{",
    "}",
    "\n",
    " ",
    ";",
    "é",
    "🙂",
];

#[derive(Arbitrary, Debug)]
pub enum Piece {
    Frag(u8),
    Str(String),
}

/// Joins pieces into model-like text.
pub fn build(pieces: &[Piece]) -> String {
    join(pieces, |i| FRAGMENTS[i as usize % FRAGMENTS.len()])
}

/// Joins the first 64 pieces, fragment `i` spelled by `frag(i)`.
pub fn join(pieces: &[Piece], frag: impl Fn(u8) -> &'static str) -> String {
    let mut s = String::new();
    for p in pieces.iter().take(64) {
        match p {
            Piece::Frag(i) => s.push_str(frag(*i)),
            Piece::Str(t) => s.push_str(t),
        }
    }
    s
}

/// Cuts `s` into chunks of 1..=8 characters, sizes taken from `cuts`.
pub fn chunk(s: &str, cuts: &[u8]) -> Vec<String> {
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

pub fn family(i: u8) -> Option<cairn_text::Family> {
    use cairn_text::Family::*;
    [
        None,
        Some(Hermes),
        Some(Qwen3Coder),
        Some(Llama3),
        Some(Mistral),
    ][i as usize % 5]
}
