//! Tool calls whose arguments contain tag text: code in a JSON string or a
//! Qwen3-Coder value may hold the very tags that delimit the call. None of
//! it may end the call early, be lost, or leak into visible text, whatever
//! the family and the chunking.
mod common;

use cairn_text::Family;
use common::calls::well_formed;
use common::parse::{call, calls_of, check, parsed, reasoning, stream, tc, text};
use common::{random_chunks, random_text, Rng};
use serde_json::json;

const FAMILIES: [Family; 4] = [
    Family::Hermes,
    Family::Qwen3Coder,
    Family::Llama3,
    Family::Mistral,
];

#[test]
fn hermes_closing_tag_inside_a_string() {
    let body = r#"{"name": "write", "arguments": {"content": "a </tool_call> b <tool_call> c"}}"#;
    let args = r#"{"content":"a </tool_call> b <tool_call> c"}"#;
    for family in [Family::Hermes, Family::Qwen3Coder] {
        for reasoning in [false, true] {
            check(
                &format!("Hi<tool_call>{body}</tool_call> done"),
                Some(family),
                reasoning,
                false,
                &[text("Hi"), tc("write", args, body), text("done")],
            );
        }
    }
}

#[test]
fn hermes_escapes_and_think_tags_inside_strings() {
    // `\"` stays inside the string; `\\` before the closing quote does not.
    let body = r#"{"name": "w", "arguments": {"c": "<think>x</think> \"</tool_call>\" \\"}}"#;
    let args = r#"{"c":"<think>x</think> \"</tool_call>\" \\"}"#;
    check(
        &format!("<think>plan</think><tool_call>\n{body}\n</tool_call>"),
        Some(Family::Hermes),
        true,
        false,
        &[reasoning("plan"), tc("w", args, &format!("\n{body}\n"))],
    );
    // Brackets inside strings do not close anything either.
    let body = r#"{"name": "w", "arguments": {"c": "}}]] {"}}"#;
    check(
        &format!("<tool_call>{body}</tool_call>"),
        Some(Family::Hermes),
        false,
        false,
        &[tc("w", r#"{"c":"}}]] {"}"#, body)],
    );
}

#[test]
fn markers_inside_strings_are_dropped_but_do_not_end_the_call() {
    let input = r#"<tool_call>{"name": "f", "arguments": {"s": "x<|im_end|>y"}}</tool_call>"#;
    let raw = r#"{"name": "f", "arguments": {"s": "xy"}}"#;
    check(
        input,
        Some(Family::Hermes),
        false,
        false,
        &[tc("f", r#"{"s":"xy"}"#, raw)],
    );
    let input =
        r#"<|python_tag|>{"name": "f", "parameters": {"s": "a<|eom_id|>b"}}<|eom_id|>after"#;
    let raw = r#"{"name": "f", "parameters": {"s": "ab"}}"#;
    check(
        input,
        Some(Family::Llama3),
        false,
        false,
        &[tc("f", r#"{"s":"ab"}"#, raw), text("after")],
    );
}

#[test]
fn qwen3_coder_tags_inside_values() {
    let code = "print(\"</parameter>\")\n# </function> and </tool_call>\nx = '<parameter=y>'";
    let body = format!(
        "\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=code>\n{code}\n</parameter>\n</function>\n"
    );
    let args = json!({"path": "a.py", "code": code}).to_string();
    for reasoning in [false, true] {
        check(
            &format!("Writing.\n<tool_call>{body}</tool_call>\nDone."),
            Some(Family::Qwen3Coder),
            reasoning,
            false,
            &[text("Writing.\n"), tc("write", &args, &body), text("Done.")],
        );
    }
    // A `</function></tool_call>` that is not at the structural end of the
    // value: the `</parameter>` before it is not followed by structure.
    let v = "a</parameter>\n</function>b";
    let body = format!("<function=f><parameter=v>\n{v}\n</parameter></function>");
    check(
        &format!("<tool_call>{body}</tool_call>"),
        Some(Family::Qwen3Coder),
        false,
        false,
        &[tc("f", &json!({ "v": v }).to_string(), &body)],
    );
    // No parameter yet: nothing to be inside, so `</tool_call>` closes.
    let bad = "<tool_call><function=f></tool_call>";
    check(bad, Some(Family::Qwen3Coder), false, false, &[text(bad)]);
}

#[test]
fn llama3_tag_text_inside_strings() {
    let body = r#"{"name": "run", "parameters": {"cmd": "a}]b <|python_tag|>"}}"#;
    check(
        &format!("<|python_tag|>{body}<|eom_id|>"),
        Some(Family::Llama3),
        false,
        false,
        &[tc("run", r#"{"cmd":"a}]b <|python_tag|>"}"#, body)],
    );
    // A bare JSON call ends at its closing brace, not at one in a string,
    // and `<think>` in a string does not start reasoning.
    let a = r#"{"name": "say", "parameters": {"t": "} <think> {"}}"#;
    let b = r#"{"name": "b", "parameters": {}}"#;
    check(
        &format!("{a}; {b}"),
        Some(Family::Llama3),
        true,
        false,
        // The separator leads the second call's raw text (existing accounting).
        &[
            tc("say", r#"{"t":"} <think> {"}"#, a),
            tc("b", "{}", &format!("; {b}")),
        ],
    );
}

#[test]
fn mistral_tag_text_inside_strings() {
    let arr = r#"[{"name": "a", "arguments": {"s": "[TOOL_CALLS] ]}"}}]"#;
    check(
        &format!("Ok.[TOOL_CALLS]{arr}"),
        Some(Family::Mistral),
        false,
        false,
        &[text("Ok."), tc("a", r#"{"s":"[TOOL_CALLS] ]}"}"#, arr)],
    );
    let f = r#"f[ARGS]{"s": "[TOOL_CALLS]g[ARGS]{}"}"#;
    let segs = parsed(
        &format!("[TOOL_CALLS]{f}[TOOL_CALLS]g[ARGS]{{}}"),
        Family::Mistral,
    );
    assert_eq!(
        calls_of(&segs),
        vec![
            call("f", r#"{"s":"[TOOL_CALLS]g[ARGS]{}"}"#),
            call("g", "{}")
        ]
    );
}

#[test]
fn an_unclosed_string_runs_to_the_end_and_comes_back_as_text() {
    let input = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"x}}</tool_call>\nafter<think>r</think>";
    check(input, Some(Family::Hermes), true, false, &[text(input)]);
    let input = "<tool_call><function=f><parameter=a>x</tool_call> rest";
    check(
        input,
        Some(Family::Qwen3Coder),
        false,
        false,
        &[text(input)],
    );
    let input = r#"[TOOL_CALLS][{"name": "a", "arguments": {"s": "x}]"#;
    check(input, Some(Family::Mistral), false, false, &[text(input)]);
}

/// Tag text, quotes, escapes and brackets: what an argument string is made of.
const PIECES: &[&str] = &[
    "a",
    " ",
    "\n",
    "\"",
    "\\",
    "\\u003c",
    "{",
    "}",
    "[",
    "]",
    "<",
    ">",
    "é",
    "🙂",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<|python_tag|>",
    "<|im_",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<function=f>",
    "</function>",
    "<parameter=p>",
    "</parameter>",
];

#[test]
fn random_tag_text_arguments_round_trip_under_any_chunking() {
    let mut rng = Rng(0x7a97_e11f_0000_5eed);
    let mut tried = 0;
    while tried < 4000 {
        let s = random_text(&mut rng, PIECES, 10);
        let family = *rng.pick(&FAMILIES);
        let form = rng.below(2) == 1;
        let Some((input, want)) = well_formed(family, form, &s) else {
            continue;
        };
        tried += 1;
        let reasoning = rng.below(2) == 1;
        let chunks = random_chunks(&input, &mut rng);
        let got = stream(&input, &chunks, Some(family), reasoning, false);
        assert_eq!(got, want, "{family} input {input:?} chunks {chunks:?}");
    }
}
