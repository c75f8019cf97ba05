//! Ending a stream that generation cut (`max_tokens`): `flush_cut` releases
//! held text exactly as `flush` does, but a tool call still open is dropped,
//! so none of its markup reaches the text. Must-hold cases per family and
//! for the pipeline; the properties are in cut_props.rs.
mod common;

use cairn_text::{Family, Segment, TextPipeline};
use common::chunks_of;
use common::parse::{
    flushed as flush, pipeline_end as pipe_run, reasoning, run_end as run, tc, text,
};

/// The cut result of `input`, checked the same for chunk sizes 1, 2, 3, 5, 8.
fn cut(input: &str, family: Option<Family>, r: bool, sir: bool) -> Vec<Segment> {
    let whole = run(&[input.to_owned()], family, r, sir, true);
    for n in [1, 2, 3, 5, 8] {
        let got = run(&chunks_of(input, n), family, r, sir, true);
        assert_eq!(got, whole, "chunk size {n}, input {input:?}");
    }
    whole
}

/// `input` cut gives `want_cut`; flushed it still gives `want_flush`.
fn check(
    input: &str,
    family: Option<Family>,
    r: bool,
    want_cut: &[Segment],
    want_flush: &[Segment],
) {
    assert_eq!(cut(input, family, r, false), want_cut, "cut {input:?}");
    assert_eq!(
        flush(input, family, r, false),
        want_flush,
        "flush {input:?}"
    );
}

/// Cut and flush agree: nothing was open at the end.
fn same(input: &str, family: Option<Family>, r: bool, want: &[Segment]) {
    check(input, family, r, want, want);
}

// ---- OutputParser's own families ------------------------------------------

#[test]
fn hermes_open_call_is_dropped() {
    let h = Some(Family::Hermes);
    let open = r#"<tool_call>{"name": "get_weather", "argu"#;
    check(
        &format!("Checking.{open}"),
        h,
        false,
        &[text("Checking.")],
        &[text(&format!("Checking.{open}"))],
    );
    // Complete JSON, but the model never closed the call: a cut may fall
    // right after a value that was meant to go on.
    let body = r#"{"name": "f", "arguments": {"a": 1}}"#;
    check(
        &format!("<tool_call>{body}"),
        h,
        false,
        &[],
        &[tc("f", r#"{"a":1}"#, body)],
    );
    // An earlier closed call and reasoning stay.
    let input = format!("<think>plan</think>Sure.<tool_call>{body}</tool_call>\n{open}");
    check(
        &input,
        h,
        true,
        &[
            reasoning("plan"),
            text("Sure."),
            tc("f", r#"{"a":1}"#, body),
        ],
        &[
            reasoning("plan"),
            text("Sure."),
            tc("f", r#"{"a":1}"#, body),
            text(open),
        ],
    );
    // Cut inside the closing tag, or just after the opening one.
    check(
        &format!("a<tool_call>{body}</tool_ca"),
        h,
        false,
        &[text("a")],
        &[text(&format!("a<tool_call>{body}</tool_ca"))],
    );
    check(
        "a<tool_call>",
        h,
        false,
        &[text("a")],
        &[text("a<tool_call>")],
    );
    // Cut inside reasoning: it stays reasoning.
    same("<think>pla", h, true, &[reasoning("pla")]);
}

#[test]
fn held_text_is_released_as_at_flush() {
    let h = Some(Family::Hermes);
    // A false alarm, a partial tag that never completed, held markers.
    same("a < b <b>", h, true, &[text("a < b <b>")]);
    // The start of a call-opening tag is the call being written: dropped at a
    // cut (a lone `<` is too little to tell).
    check(
        "ends with <tool_ca",
        h,
        true,
        &[text("ends with ")],
        &[text("ends with <tool_ca")],
    );
    same("ends with <", h, true, &[text("ends with <")]);
    same("x<|im_e", h, false, &[text("x<|im_e")]);
    same("<think>a</thi", h, true, &[reasoning("a</thi")]);
    // Without a family tool tags are text, open or not.
    let input = r#"a<tool_call>{"name": "f""#;
    same(input, None, true, &[text(input)]);
    // Llama holds leading whitespace (it may open a bare JSON call).
    same("  \n", Some(Family::Llama3), false, &[text("  \n")]);
    // Mistral: a `[` that is not a tag.
    check(
        "[1, 2] [TOOL",
        Some(Family::Mistral),
        false,
        &[text("[1, 2] ")],
        &[text("[1, 2] [TOOL")],
    );
    // A sectioned family: the same for its opening tag, text otherwise.
    let glm = Some(Family::Glm45);
    check(
        "ok <tool_c",
        glm,
        false,
        &[text("ok ")],
        &[text("ok <tool_c")],
    );
    same("ok <b", glm, false, &[text("ok <b")]);
}

#[test]
fn qwen3_coder_open_call_is_dropped() {
    let q = Some(Family::Qwen3Coder);
    let open = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo";
    let input = format!("<think>need weather</think>Checking.\n{open}");
    check(
        &input,
        q,
        true,
        &[reasoning("need weather"), text("Checking.\n")],
        &[
            reasoning("need weather"),
            text(&format!("Checking.\n{open}")),
        ],
    );
}

#[test]
fn llama3_open_calls_are_dropped() {
    let l = Some(Family::Llama3);
    let body = r#"{"name": "search", "parameters": {"q": "rust"}}"#;
    // After <|python_tag|>: a call until an end marker, complete JSON or not.
    let open = r#"<|python_tag|>{"name": "search", "parameters": {"q": "ru"#;
    check(open, l, false, &[], &[text(open)]);
    check(
        &format!("<|python_tag|>{body}"),
        l,
        false,
        &[],
        &[tc("search", r#"{"q":"rust"}"#, body)],
    );
    same(
        &format!("<|python_tag|>{body}<|eom_id|>"),
        l,
        false,
        &[tc("search", r#"{"q":"rust"}"#, body)],
    );
    // A bare JSON reply that already looks like a call.
    let open = r#"{"name": "search", "parameters": {"q": "ru"#;
    check(open, l, false, &[], &[text(open)]);
    check(
        r#" {"function": {"na"#,
        l,
        false,
        &[],
        &[text(r#" {"function": {"na"#)],
    );
    // One that does not (yet) is text: it may be the answer itself.
    same(r#"{"answer": 4"#, l, false, &[text(r#"{"answer": 4"#)]);
    same(r#"{"na"#, l, false, &[text(r#"{"na"#)]);
    same("{", l, false, &[text("{")]);
    // A closed bare call stays; the next one, open, goes.
    let a = r#"{"name": "a", "parameters": {}}"#;
    check(
        &format!(r#"{a}; {{"name": "b", "#),
        l,
        false,
        &[tc("a", "{}", a)],
        &[tc("a", "{}", a), text(r#"; {"name": "b", "#)],
    );
}

#[test]
fn mistral_open_call_is_dropped() {
    let m = Some(Family::Mistral);
    let open = r#"[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b""#;
    check(
        &format!("Let me.{open}"),
        m,
        false,
        &[text("Let me.")],
        &[text(&format!("Let me.{open}"))],
    );
    // The last call ends only at the end of the stream: at a cut it is open.
    let first = r#"get_weather[ARGS]{"city": "Paris"}"#;
    let call = tc("get_weather", r#"{"city":"Paris"}"#, first);
    check(
        &format!("[TOOL_CALLS]{first}"),
        m,
        false,
        &[],
        std::slice::from_ref(&call),
    );
    // One closed by the next [TOOL_CALLS] stays.
    check(
        &format!("[TOOL_CALLS]{first}[TOOL_CALLS]f[ARGS]{{\"a"),
        m,
        false,
        std::slice::from_ref(&call),
        &[call.clone(), text("[TOOL_CALLS]f[ARGS]{\"a")],
    );
    // Reasoning in [THINK] stays.
    check(
        "[THINK]hm[/THINK][TOOL_CALLS]f[ARGS]{",
        m,
        true,
        &[reasoning("hm")],
        &[reasoning("hm"), text("[TOOL_CALLS]f[ARGS]{")],
    );
}

// ---- the families of `formats` --------------------------------------------

#[test]
fn harmony_open_call_is_dropped() {
    let h = Some(Family::Harmony);
    let head = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>";
    check(
        &format!("{head}{{\"city\": \"Par"),
        h,
        true,
        &[reasoning("Need weather.")],
        &[reasoning("Need weather."), text("{\"city\": \"Par")],
    );
    // No <|call|> yet: open, however complete the JSON looks.
    let input = " to=functions.now<|channel|>commentary json<|message|>{}";
    check(input, h, true, &[], &[tc("now", "{}", "{}")]);
    // A header that already names a tool, cut before its first tag or on a
    // partial one (a false alarm would make the header prose at flush).
    check(
        " to=functions.now",
        h,
        true,
        &[],
        &[text(" to=functions.now")],
    );
    check(
        " to=functions.now<|chan",
        h,
        true,
        &[],
        &[text(" to=functions.now<|chan")],
    );
    let head = "<|channel|>commentary to=functions.f <|constr";
    check(head, h, true, &[], &[text(head)]);
    // A header naming no tool stays prose, as at flush.
    same(
        "<|channel|>final<|mess",
        h,
        true,
        &[text("<|channel|>final<|mess")],
    );
    // Prose, a header with tags (structure), a final answer: as at flush.
    same("Hello, world", h, true, &[text("Hello, world")]);
    same("<|channel|>commentary to=functions.f", h, true, &[]);
    same(
        "<|channel|>final<|message|>It is 20",
        h,
        true,
        &[text("It is 20")],
    );
    // A closed call stays; the next one, open, goes.
    let input = "<|channel|>commentary to=functions.f<|message|>{\"a\": 1}<|call|><|start|>assistant<|channel|>commentary to=functions.g<|message|>{\"b";
    check(
        input,
        h,
        true,
        &[tc("f", r#"{"a":1}"#, r#"{"a": 1}"#)],
        &[tc("f", r#"{"a":1}"#, r#"{"a": 1}"#), text("{\"b")],
    );
}

#[test]
fn sectioned_open_sections_are_dropped() {
    // (family, reasoning, text before, an open section, a closed one)
    let cases: &[(Family, &str, &str, &str)] = &[
        (
            Family::Glm45,
            "<think>plan</think>\nSure.",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beij",
            "<tool_call>now\n</tool_call>",
        ),
        (
            Family::DeepSeekV3,
            "<think>plan</think>Sure.",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        (
            Family::KimiK2,
            "<think>plan</think>Sure.",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            Family::Gemma4,
            "<|channel>thought\nplan<channel|>Sure.",
            "<|tool_call>call:get_weather{city:<|\"|>Par",
            "<|tool_call>call:now{}<tool_call|>",
        ),
        (
            Family::MiniMaxM2,
            "<think>plan</think>Sure.",
            "<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"p\">1</parameter>\n</invoke>\n",
            "<minimax:tool_call>\n<invoke name=\"now\">\n</invoke>\n</minimax:tool_call>",
        ),
    ];
    for &(family, before, open, closed) in cases {
        let f = Some(family);
        let head = [reasoning("plan"), text("Sure.")];
        let got = cut(&format!("{before}{open}"), f, true, false);
        assert_eq!(got, head, "{family}");
        // Flushed, the same open section is parsed: a call, or its text.
        let flushed = flush(&format!("{before}{open}"), f, true, false);
        let sure_open = text(&format!("Sure.{open}"));
        assert!(
            matches!(&flushed[..], [_, _, Segment::ToolCall(_)]) || flushed[1] == sure_open,
            "{family} {flushed:?}"
        );
        // A closed section before the open one stays.
        let got = cut(&format!("{before}{closed}{open}"), f, true, false);
        assert!(
            matches!(&got[..], [_, _, Segment::ToolCall(c)] if c.name == "now"),
            "{family} {got:?}"
        );
        // Cut on a partial section tag: the call being opened, dropped.
        let partial = &open[..open.char_indices().nth(4).unwrap().0];
        check(
            &format!("Sure.{partial}"),
            f,
            true,
            &[text("Sure.")],
            &[text(&format!("Sure.{partial}"))],
        );
    }
    same("<think>pla", Some(Family::Glm45), true, &[reasoning("pla")]);
    // Gemma's label held at the cut is reasoning, as at flush.
    same(
        "<|channel>though",
        Some(Family::Gemma4),
        true,
        &[reasoning("though")],
    );
}

#[test]
fn pythonic_open_calls_are_dropped() {
    let p = Some(Family::Pythonic);
    check(
        "[get_weather(city='Par",
        p,
        false,
        &[],
        &[text("[get_weather(city='Par")],
    );
    check("  [ m.f (", p, false, &[], &[text("  [ m.f (")]);
    check(
        "<think>x</think>\n[f(a=1), g(",
        p,
        true,
        &[reasoning("x")],
        &[reasoning("x"), text("\n[f(a=1), g(")],
    );
    check(
        "<|python_start|>f(a=1)",
        p,
        false,
        &[],
        &[tc("f", r#"{"a":1}"#, "f(a=1)")],
    );
    check(
        "<|python_start|>[f(a=",
        p,
        false,
        &[],
        &[text("<|python_start|>[f(a=")],
    );
    // A list that does not look like calls yet may be the answer.
    same("[1, 2", p, false, &[text("[1, 2")]);
    same("[Note", p, false, &[text("[Note")]);
    same("  [f", p, false, &[text("  [f")]);
    // A closed list stays.
    same("[f()]", p, false, &[tc("f", "{}", "[f()]")]);
}

// ---- the pipeline ----------------------------------------------------------

#[test]
fn pipeline_cut_releases_partial_stops_and_drops_open_calls() {
    let h = Some(Family::Hermes);
    let one = |s: &str| vec![s.to_owned()];
    // A held partial stop match is text.
    assert_eq!(
        pipe_run(&["###"], &one("Hi ##"), h, true),
        (vec![text("Hi ##")], None)
    );
    // A held partial stop match inside an open call goes with the call.
    let input = r#"Hi<tool_call>{"name": "f", "arguments": {}}"#;
    assert_eq!(
        pipe_run(&["}}}"], &one(input), h, true),
        (vec![text("Hi")], None)
    );
    assert_eq!(pipe_run(&["}}}"], &one(input), h, false).0.len(), 2);
    // After a stop the stream ended normally: the cut adds nothing.
    let input = r#"a<tool_call>{"name": "f", "arguments": {}}###<tool_call>{"#;
    assert_eq!(
        pipe_run(&["###"], &one(input), h, true),
        (
            vec![
                text("a"),
                tc("f", "{}", r#"{"name": "f", "arguments": {}}"#)
            ],
            Some(0)
        )
    );
    // The pipeline is reset after a cut.
    let mut p = TextPipeline::new(&["###"], h, false, false).unwrap();
    p.push("<tool_call>{");
    assert_eq!(p.flush_cut(), vec![]);
    assert_eq!(p.push("ok").0, vec![text("ok")]);
}
