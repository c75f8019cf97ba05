//! Properties of `flush_cut` (generation cut by `max_tokens`), for every
//! family: any chunking gives the same result; the result is the flushed
//! one up to the call left open; a well-formed call cut at any character is
//! either whole or absent, never text; and the pipeline cuts as "reference
//! stop scan, then parser cut" does.
mod common;

use cairn_text::{reference, Family, Segment};
use common::calls::{python_str, section, writable};
use common::parse::{flushed as flush, pipeline_end as pipe_run, run_end as run};
use common::{random_chunks, random_text, Rng};
use serde_json::json;

/// Random cases per property test; `CAIRN_TEXT_CASES` raises it.
fn iterations() -> usize {
    std::env::var("CAIRN_TEXT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// Fragments of every family's syntax, and text that looks like it.
#[rustfmt::skip]
const ALPHABET: &[&str] = &[
    "a", " ", "\n", "<", ">", "{", "}", "[", "]", "(", ")", "=", ",", ":", ";", "\"", "'", "\\",
    "é", "🙂", "|", "<think>", "</think>", "<|im_end|>", "<|eom_id|>",
    // hermes / qwen3-coder / glm
    "<tool_call>", "</tool_call>", "<tool_", r#"{"name": "f", "arguments": {"a": "<b>"}}"#,
    r#"{"name": "f", "#, "<function=g>", "<parameter=p>", "</parameter>", "</function>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "f\n",
    // llama3 / mistral
    "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]", r#"{"name": "#,
    r#"[{"name": "f", "arguments": {}}]"#,
    // harmony
    "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary",
    " to=functions.f", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>",
    // deepseek / kimi
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    // gemma / minimax / pythonic
    "<|channel>", "thought\n", "<channel|>", "<|tool_call>", "call:f{", "<|\"|>", "<tool_call|>",
    "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=\"f\">", "</invoke>",
    "[f(p=1)]", "f(", "p=", "<|python_start|>", "<|python_end|>", r#"{"p": 1}"#,
];

/// `cut` is `flush` up to where the open call began: equal segments, except
/// that the last one of `cut` may be a shorter text.
fn assert_cut_prefix(cut: &[Segment], flush: &[Segment], ctx: &str) {
    let k = cut.len();
    assert!(k <= flush.len(), "{ctx}: cut {cut:?} flush {flush:?}");
    if k == 0 {
        return;
    }
    assert_eq!(cut[..k - 1], flush[..k - 1], "{ctx}");
    match (&cut[k - 1], &flush[k - 1]) {
        (Segment::Text(a), Segment::Text(b)) => {
            assert!(b.starts_with(a.as_str()), "{ctx}: {a:?} {b:?}")
        }
        (a, b) => assert_eq!(a, b, "{ctx}"),
    }
}

#[test]
fn random_cuts_are_chunking_invariant_and_a_prefix_of_flush() {
    let mut rng = Rng(0xc07_0000_5eed_0001);
    let families: Vec<Option<Family>> = std::iter::once(None)
        .chain(Family::ALL.iter().copied().map(Some))
        .collect();
    for _ in 0..iterations() {
        let input = random_text(&mut rng, ALPHABET, 14);
        let family = *rng.pick(&families);
        let r = rng.below(2) == 1;
        let sir = r && rng.below(3) == 0;
        let chunks = random_chunks(&input, &mut rng);
        let ctx = format!("{family:?} r={r} sir={sir} input {input:?} chunks {chunks:?}");
        let whole = run(std::slice::from_ref(&input), family, r, sir, true);
        assert_eq!(run(&chunks, family, r, sir, true), whole, "{ctx}");
        assert_cut_prefix(&whole, &flush(&input, family, r, sir), &ctx);
    }
}

/// Where a cut must drop a call: (where its markup starts, where the call
/// is committed, where it is closed), byte offsets.
type Window = (usize, usize, usize);

/// A well-formed call in `family`'s syntax with argument `p` = `s`, and the
/// windows where a cut must drop it. `None` where `s` cannot be written in
/// that syntax.
fn with_windows(family: Family, s: &str) -> Option<(String, Vec<Window>)> {
    if !writable(family, s) {
        return None;
    }
    let args = json!({ "p": s }).to_string();
    let obj = |key: &str| json!({"name": "f", key: {"p": s}}).to_string();
    Some(match family {
        Family::Llama3 if s.len() % 2 == 0 => {
            let input = format!("<|python_tag|>{}<|eom_id|>", obj("parameters"));
            let n = input.len();
            (input, vec![(0, "<|python_tag|>".len(), n)])
        }
        Family::Llama3 => {
            let input = obj("parameters");
            let n = input.len();
            // Committed once the first key is whole: `{"name"`.
            (input, vec![(0, r#"{"name""#.len(), n)])
        }
        Family::Mistral => {
            // The first call closes at the next [TOOL_CALLS]; the last never.
            let first = format!("f[ARGS]{args}");
            let input = format!("Hi [TOOL_CALLS]{first}[TOOL_CALLS]g[ARGS]{{}}");
            let second = 3 + 12 + first.len();
            let n = input.len();
            (
                input,
                vec![(3, 15, second + 12), (second, second + 12, n + 1)],
            )
        }
        Family::Harmony => {
            let head = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>";
            let call = format!("{head}{args}<|call|>");
            let n = call.len();
            let input = format!("{call}<|start|>assistant<|channel|>final<|message|>bye");
            // Committed once the header names a tool (`to=f`).
            let named = head.find("to=").unwrap() + 4;
            (input, vec![(0, named, n)])
        }
        Family::Pythonic => {
            let body = format!("[f(p={})]", python_str(s));
            if s.len() % 2 == 0 {
                let n = body.len();
                // Committed at `[f(`: before that it may be a plain list.
                (format!("{body} bye"), vec![(0, 3, n)])
            } else {
                let input = format!("<|python_start|>{body}<|python_end|>done");
                let n = input.len() - "done".len();
                (input, vec![(0, "<|python_start|>".len(), n)])
            }
        }
        // `Hi OPEN body CLOSE bye`: one window from OPEN to the end of CLOSE.
        _ => {
            let (open, body, close) = section(family, s)?;
            let input = format!("Hi {open}{body}{close} bye");
            let end = input.len() - " bye".len();
            (input, vec![(3, 3 + open.len(), end)])
        }
    })
}

/// Argument text: tag text, quotes, escapes.
#[rustfmt::skip]
const ARG_PIECES: &[&str] = &[
    "a", " ", "\n", "é", "🙂", "<", ">", "\"", "'", "\\", "{", "}", "[", "]", "(", ")", ",", ":",
    "=", "</think>", "<tool_call>", "</tool_call>", "</arg_value>", "</parameter>", "</invoke>",
    "<tool_call|>", "<|call|>", "<|channel|>", "<|tool_call_end|>", "<|python_end|>",
    "[TOOL_CALLS]", "<|eom_id|>", "1",
];

/// Tags that open a call where text is read: a cut inside one drops it.
const OPENING: &[&str] = &[
    "<tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "<|tool_call>",
    "<minimax:tool_call>",
    "<｜tool▁calls▁begin｜>",
    "<|tool_calls_section_begin|>",
    "<|python_start|>",
];

#[test]
fn a_call_cut_anywhere_is_whole_or_absent() {
    let mut rng = Rng(0xc07_0000_5eed_0002);
    let mut tried = 0;
    while tried < iterations() / 4 {
        let s = random_text(&mut rng, ARG_PIECES, 8);
        let family = *rng.pick(&Family::ALL);
        let Some((input, windows)) = with_windows(family, &s) else {
            continue;
        };
        tried += 1;
        let r = rng.below(2) == 1;
        for (i, _) in input.char_indices().chain([(input.len(), ' ')]) {
            let prefix = &input[..i];
            let ctx = format!("{family} r={r} prefix {prefix:?}");
            // Inside an open call, or two or more characters into the tag that
            // opens it: what came before its markup.
            let opening =
                |w: &&Window| w.0 + 1 < i && i < w.1 && OPENING.contains(&&input[w.0..w.1]);
            let want = match windows.iter().find(|w| (w.1 <= i && i < w.2) || opening(w)) {
                Some(&(start, ..)) => flush(&input[..start], Some(family), r, false),
                None => flush(prefix, Some(family), r, false),
            };
            let chunks = random_chunks(prefix, &mut rng);
            assert_eq!(
                run(&chunks, Some(family), r, false, true),
                want,
                "{ctx} chunks {chunks:?}"
            );
        }
    }
}

#[test]
fn pipeline_cut_is_stop_scan_then_parser_cut() {
    let mut rng = Rng(0xc07_0000_5eed_0003);
    let stops = ["###", "</tool_call>", "}}", "\n\n", "é🙂"];
    for _ in 0..iterations() / 2 {
        let input = random_text(&mut rng, ALPHABET, 12);
        let family = *rng.pick(&[
            None,
            Some(Family::Hermes),
            Some(Family::Llama3),
            Some(Family::Harmony),
            Some(Family::Pythonic),
        ]);
        let k = rng.below(3);
        let stops: Vec<&str> = (0..k).map(|_| *rng.pick(&stops)).collect();
        let (visible, stop) = reference::stop_scan(&stops, &input);
        // A stop ends the stream normally; otherwise generation was cut.
        let want = run(
            std::slice::from_ref(&visible),
            family,
            true,
            false,
            stop.is_none(),
        );
        let chunks = random_chunks(&input, &mut rng);
        assert_eq!(
            pipe_run(&stops, &chunks, family, true),
            (want, stop),
            "{input:?} {stops:?}"
        );
    }
}
