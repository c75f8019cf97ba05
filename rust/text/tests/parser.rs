mod common;

use cairn_text::{Family, OutputParser, Segment};
use common::parse::{call, calls_of, check, parsed, reasoning, stream, tc, text};
use common::{random_chunks, random_text, Rng};

const WEATHER: &str = r#"{"name": "get_weather", "arguments": {"city": "NYC"}}"#;

#[test]
fn must_hold_hermes_call() {
    let input = format!("Sure, let me check the weather.<tool_call>{WEATHER}</tool_call>");
    check(
        &input,
        Some(Family::Hermes),
        false,
        false,
        &[
            text("Sure, let me check the weather."),
            tc("get_weather", r#"{"city":"NYC"}"#, WEATHER),
        ],
    );
}

#[test]
fn must_hold_two_calls_back_to_back() {
    let a = r#"{"name": "a", "arguments": {"x": 1}}"#;
    let b = r#"{"name": "b", "arguments": {}}"#;
    let input = format!("<tool_call>{a}</tool_call>\n<tool_call>{b}</tool_call>\n");
    check(
        &input,
        Some(Family::Hermes),
        false,
        false,
        &[tc("a", r#"{"x":1}"#, a), tc("b", "{}", b)],
    );
    let input = format!("<tool_call>\n{a}\n</tool_call><tool_call>\n{b}\n</tool_call>");
    let segs = parsed(&input, Family::Hermes);
    assert_eq!(
        calls_of(&segs),
        vec![call("a", r#"{"x":1}"#), call("b", "{}")]
    );
}

#[test]
fn must_hold_reasoning() {
    check(
        "<think>plan</think>Answer",
        Some(Family::Hermes),
        true,
        false,
        &[reasoning("plan"), text("Answer")],
    );
    check(
        "<think>plan</think>Answer",
        None,
        true,
        false,
        &[reasoning("plan"), text("Answer")],
    );
    check(
        "<think>\nplan\n</think>\n\nAnswer",
        None,
        true,
        false,
        &[reasoning("\nplan\n"), text("Answer")],
    );
}

#[test]
fn starts_inside_reasoning() {
    check(
        "plan</think>Answer<|im_end|>",
        Some(Family::Hermes),
        true,
        true,
        &[reasoning("plan"), text("Answer")],
    );
    assert!(OutputParser::new(None, false, true).is_err());
}

#[test]
fn reasoning_off_keeps_think_tags_as_text() {
    check(
        "<think>x</think>y",
        None,
        false,
        false,
        &[text("<think>x</think>y")],
    );
}

#[test]
fn markers_never_leak() {
    check(
        "Hi<|im_end|>",
        Some(Family::Hermes),
        false,
        false,
        &[text("Hi")],
    );
    check(
        "a<|eot_id|>b<end_of_turn>c<|end|>",
        None,
        true,
        false,
        &[text("abc")],
    );
    check(
        "<think>r<|im_end|></think>t",
        None,
        true,
        false,
        &[reasoning("r"), text("t")],
    );
}

#[test]
fn false_alarms_are_released() {
    check(
        "a < b and <b>bold</b> <tool x",
        Some(Family::Hermes),
        true,
        false,
        &[text("a < b and <b>bold</b> <tool x")],
    );
    check(
        "ends with <tool_ca",
        Some(Family::Hermes),
        true,
        false,
        &[text("ends with <tool_ca")],
    );
    check(
        "[1, 2] [TOOL",
        Some(Family::Mistral),
        false,
        false,
        &[text("[1, 2] [TOOL")],
    );
}

#[test]
fn malformed_calls_come_back_as_text() {
    let bad = r#"<tool_call>{"name": "f", "arguments": {</tool_call>"#;
    check(
        &format!("x{bad}y"),
        Some(Family::Hermes),
        false,
        false,
        &[text(&format!("x{bad}y"))],
    );
    let noname = r#"<tool_call>{"arguments": {}}</tool_call>"#;
    check(noname, Some(Family::Hermes), false, false, &[text(noname)]);
}

#[test]
fn unclosed_call_at_flush() {
    let input = format!("ok<tool_call>{WEATHER}\n");
    check(
        &input,
        Some(Family::Hermes),
        false,
        false,
        &[
            text("ok"),
            tc("get_weather", r#"{"city":"NYC"}"#, &format!("{WEATHER}\n")),
        ],
    );
    let input = r#"ok<tool_call>{"name": "get_weather", "argu"#;
    check(input, Some(Family::Hermes), false, false, &[text(input)]);
}

#[test]
fn no_family_means_tool_text_is_text() {
    let input = format!("a<tool_call>{WEATHER}</tool_call>");
    check(&input, None, true, false, &[text(&input)]);
}

#[test]
fn qwen3_coder_calls() {
    let body = "\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n";
    let input = format!("<think>need weather</think>\n\nChecking.\n<tool_call>{body}</tool_call>");
    check(
        &input,
        Some(Family::Qwen3Coder),
        true,
        false,
        &[
            reasoning("need weather"),
            text("Checking.\n"),
            tc("get_weather", r#"{"city":"New York","days":3}"#, body),
        ],
    );
}

#[test]
fn llama3_calls() {
    let body = r#"{"name": "search", "parameters": {"q": "rust"}}"#;
    check(
        &format!("<|python_tag|>{body}<|eom_id|>"),
        Some(Family::Llama3),
        false,
        false,
        &[tc("search", r#"{"q":"rust"}"#, body)],
    );
    check(
        &format!("\n{body}"),
        Some(Family::Llama3),
        false,
        false,
        &[tc("search", r#"{"q":"rust"}"#, &format!("\n{body}"))],
    );
    let two = r#"{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1]}}"#;
    let segs = parsed(two, Family::Llama3);
    assert_eq!(
        calls_of(&segs),
        vec![call("a", "{}"), call("b", r#"{"k":[1]}"#)]
    );
    // A JSON answer that is not a call is text, and so is later text.
    check(
        r#"  {"answer": 42} done"#,
        Some(Family::Llama3),
        false,
        false,
        &[text(r#"  {"answer": 42} done"#)],
    );
    check(
        "Hello {x}",
        Some(Family::Llama3),
        false,
        false,
        &[text("Hello {x}")],
    );
    check(
        r#"{"name": "a""#,
        Some(Family::Llama3),
        false,
        false,
        &[text(r#"{"name": "a""#)],
    );
    check(
        "<|python_tag|>brave_search.call(q=1)",
        Some(Family::Llama3),
        false,
        false,
        &[text("<|python_tag|>brave_search.call(q=1)")],
    );
}

#[test]
fn mistral_calls() {
    let arr = r#"[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]"#;
    let segs = parsed(&format!("Let me.[TOOL_CALLS]{arr}"), Family::Mistral);
    assert_eq!(segs[0], text("Let me."));
    assert_eq!(
        calls_of(&segs),
        vec![call("a", r#"{"x":1}"#), call("b", "{}")]
    );
    let input = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}"#;
    check(
        input,
        Some(Family::Mistral),
        false,
        false,
        &[
            tc(
                "get_weather",
                r#"{"city":"Paris"}"#,
                r#"get_weather[ARGS]{"city": "Paris"}"#,
            ),
            tc("f", "{}", "f[ARGS]{}"),
        ],
    );
}

#[test]
fn mistral_think_blocks() {
    // Magistral / Ministral 3 Reasoning: `[THINK]..[/THINK]`, then a call.
    let input = r#"[THINK]Need the weather.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#;
    check(
        input,
        Some(Family::Mistral),
        true,
        false,
        &[
            reasoning("Need the weather."),
            text("Checking."),
            tc(
                "get_weather",
                r#"{"city":"Paris"}"#,
                r#"get_weather[ARGS]{"city": "Paris"}"#,
            ),
        ],
    );
    check(
        "plan[/THINK]\nAnswer.",
        Some(Family::Mistral),
        true,
        true,
        &[reasoning("plan"), text("Answer.")],
    );
    // Reasoning off: the tags are text; other families do not know them.
    check(
        "[THINK]x[/THINK]",
        Some(Family::Mistral),
        false,
        false,
        &[text("[THINK]x[/THINK]")],
    );
    check(
        "[THINK]x[/THINK]",
        Some(Family::Hermes),
        true,
        false,
        &[text("[THINK]x[/THINK]")],
    );
}

/// Random cases per property test; `CAIRN_TEXT_CASES` raises it for a deeper run.
fn iterations() -> usize {
    std::env::var("CAIRN_TEXT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// Structural tags and markers, for the leak and accounting checks.
fn strip_tags(s: &str) -> String {
    let mut s = s.to_owned();
    for t in ["<think>", "</think>", "<tool_call>", "</tool_call>"]
        .iter()
        .chain(cairn_text::END_MARKERS)
    {
        s = s.replace(t, "");
    }
    s
}

#[test]
fn random_inputs_are_chunking_invariant_and_lose_nothing() {
    let body = r#"{"name": "f", "arguments": {"a": "<b>"}}"#;
    let xml = "<function=g><parameter=p>1</parameter></function>";
    let alphabet = [
        "a",
        " ",
        "\n",
        "<",
        ">",
        "{",
        "}",
        "é",
        "🙂",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "<|im_end|>",
        "<|eot",
        body,
        xml,
        "<|python_tag|>",
        "[TOOL_CALLS]",
        ";",
        // Strings and values that may hide tag text.
        "\"",
        "\\",
        "[",
        "]",
        "<function=f>",
        "<parameter=p>",
        "</parameter>",
        "</function>",
        r#"{"name": "f", "arguments": {"s": "</tool_call><think>"#,
        r#"[{"name": "f", "arguments": {"s": "[TOOL_CALLS]<|eom_id|>"}}]"#,
    ];
    let families = [
        None,
        Some(Family::Hermes),
        Some(Family::Qwen3Coder),
        Some(Family::Llama3),
        Some(Family::Mistral),
    ];
    let mut rng = Rng(0xfeed_0000_1111_2222);
    for _ in 0..iterations() {
        let input = random_text(&mut rng, &alphabet, 12);
        let family = *rng.pick(&families);
        let reasoning = rng.below(2) == 1;
        let sir = reasoning && rng.below(3) == 0;
        let chunks = random_chunks(&input, &mut rng);
        let segs = stream(&input, &chunks, family, reasoning, sir);
        if matches!(
            family,
            None | Some(Family::Hermes) | Some(Family::Qwen3Coder)
        ) && reasoning
        {
            // Everything but tags (and whitespace dropped after blocks) is accounted for.
            let mut got = String::new();
            for s in &segs {
                match s {
                    Segment::Text(t) | Segment::Reasoning(t) => got.push_str(t),
                    Segment::ToolCall(c) => got.push_str(&c.raw),
                }
            }
            let squash = |s: &str| {
                strip_tags(s)
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .collect::<String>()
            };
            assert_eq!(squash(&got), squash(&input), "input {input:?}");
        }
        for s in &segs {
            if let Segment::Text(t) = s {
                for m in cairn_text::END_MARKERS {
                    assert!(!t.contains(m), "marker in text: {input:?}");
                }
            }
        }
    }
}
