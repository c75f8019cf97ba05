//! The families of `cairn_text::formats`: harmony, GLM-4.5, DeepSeek V3 /
//! V3.1, Kimi K2, Gemma 4, MiniMax M2 and pythonic calls. Must-hold cases
//! under every chunk size, then random inputs: any chunking equals the
//! one-shot parse, well-formed calls with arbitrary argument text round-trip,
//! and no tag reaches visible text.
mod common;

use cairn_text::{Family, OutputParser, Segment, ToolSchemas};
use common::calls::well_formed;
use common::parse::{check, parsed, reasoning, stream, tc, text};
use common::{random_chunks, random_text, Rng};
use serde_json::json;

/// The families of `cairn_text::formats`: every one after Mistral.
const NEW: &[Family] = Family::ALL.as_slice().split_at(4).1;

// ---- harmony --------------------------------------------------------------

#[test]
fn harmony_reasoning_call_and_answer() {
    let h = Some(Family::Harmony);
    let input = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
    let want = [
        reasoning("Need weather."),
        tc("get_weather", r#"{"city":"Paris"}"#, r#"{"city": "Paris"}"#),
    ];
    for r in [false, true] {
        check(input, h, r, false, &want);
    }
    let input = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 20°C.<|return|>";
    check(
        input,
        h,
        true,
        false,
        &[reasoning("Easy."), text("It is 20°C.")],
    );
    // The recipient in the role part, `json` without <|constrain|>, no <|call|>
    // (the engine never hands over the end-of-generation token).
    let input = " to=functions.now<|channel|>commentary json<|message|>{}";
    check(input, h, true, false, &[tc("now", "{}", "{}")]);
    // A commentary preamble without a recipient is visible text.
    let input = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary<|message|>{\"a\": [1]}";
    check(
        input,
        h,
        true,
        false,
        &[text("Checking."), tc("f", r#"{"a":[1]}"#, r#"{"a": [1]}"#)],
    );
}

#[test]
fn harmony_prose_and_malformed() {
    let h = Some(Family::Harmony);
    // A model answering without harmony: its text is text.
    check("Hello, world", h, true, false, &[text("Hello, world")]);
    check("Hi there", h, true, false, &[text("Hi there")]);
    // A call whose arguments are not a JSON object: the content as text.
    let input = "<|channel|>commentary to=functions.f<|message|>not json<|call|>";
    check(input, h, true, false, &[text("not json")]);
    // A prompt that opened the analysis message.
    check(
        "plan<|end|><|start|>assistant<|channel|>final<|message|>ok",
        h,
        true,
        true,
        &[reasoning("plan"), text("ok")],
    );
    // A header cut by the end of the stream is structure: dropped.
    check("<|channel|>analys", h, true, false, &[]);
    // Lone `<` and markers.
    check(
        "<|channel|>final<|message|>a < b<|endoftext|>",
        h,
        true,
        false,
        &[text("a < b")],
    );
}

// ---- GLM-4.5 --------------------------------------------------------------

#[test]
fn glm45_calls() {
    let g = Some(Family::Glm45);
    let body = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n";
    let input = format!(
        "<think>plan</think>\nSure.<tool_call>{body}</tool_call>\n<tool_call>now\n</tool_call>"
    );
    check(
        &input,
        g,
        true,
        false,
        &[
            reasoning("plan"),
            text("Sure."),
            tc("get_weather", r#"{"city":"Beijing","days":2}"#, body),
            tc("now", "{}", "now\n"),
        ],
    );
    // Schemas: a string parameter stays a string.
    let input = "<tool_call>f<arg_key>zip</arg_key><arg_value>01234</arg_value><arg_key>n</arg_key><arg_value>5</arg_value></tool_call>";
    let mut p = OutputParser::new(g, false, false).unwrap();
    p.set_tool_schemas(
        ToolSchemas::from_json(
            r#"{"f": {"properties": {"zip": {"type": "string"}, "n": {"type": "integer"}}}}"#,
        )
        .unwrap(),
    );
    let mut segs = p.push(input);
    segs.extend(p.flush());
    assert!(
        matches!(&segs[..], [Segment::ToolCall(c)] if c.arguments == r#"{"zip":"01234","n":5}"#),
        "{segs:?}"
    );
    // Without schemas the same value is a number where JSON reads it as one.
    let segs = parsed(
        "<tool_call>f<arg_key>n</arg_key><arg_value>5</arg_value></tool_call>",
        Family::Glm45,
    );
    assert!(matches!(&segs[..], [Segment::ToolCall(c)] if c.arguments == r#"{"n":5}"#));
    // Tag text in a value; a malformed call comes back as text.
    let v = "print('</tool_call>')";
    let body = format!("w<arg_key>code</arg_key><arg_value>{v}</arg_value>");
    check(
        &format!("<tool_call>{body}</tool_call>"),
        g,
        false,
        false,
        &[tc("w", &json!({ "code": v }).to_string(), &body)],
    );
    let bad = "<tool_call>f<arg_key>a</arg_key></tool_call>";
    check(bad, g, false, false, &[text(bad)]);
}

#[test]
fn leading_layout_whitespace_is_dropped() {
    // GLM-4.5 / 4.6 write `\n<think>` right after `<|assistant|>`; a
    // template's layout may put spaces before DeepSeek's call section.
    let body = "f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n";
    check(
        &format!("\n<think>plan</think>\n<tool_call>{body}</tool_call>"),
        Some(Family::Glm45),
        true,
        false,
        &[reasoning("plan"), tc("f", r#"{"a":1}"#, body)],
    );
    check(
        "\n \nHello\n",
        Some(Family::Glm45),
        true,
        false,
        &[text("Hello\n")],
    );
    let call = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>";
    check(
        &format!("   <｜tool▁calls▁begin｜>{call}<｜tool▁calls▁end｜>"),
        Some(Family::DeepSeekV3),
        false,
        false,
        &[tc("f", "{}", call)],
    );
}

// ---- DeepSeek -------------------------------------------------------------

#[test]
fn deepseek_v3_and_v31() {
    let d = Some(Family::DeepSeekV3);
    let call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>";
    let input = format!(
        "Let me check.<｜tool▁calls▁begin｜>{call}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    );
    check(
        &input,
        d,
        false,
        false,
        &[
            text("Let me check."),
            tc("get_weather", r#"{"city":"Paris"}"#, call),
        ],
    );
    let a = "<｜tool▁call▁begin｜>a<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜>";
    let b = "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜>";
    let input = format!("<think>hm</think><｜tool▁calls▁begin｜>{a}{b}<｜tool▁calls▁end｜>");
    let raw = format!("{a}{b}");
    check(
        &input,
        d,
        true,
        false,
        &[
            reasoning("hm"),
            tc("a", r#"{"x":1}"#, &raw),
            tc("b", "{}", ""),
        ],
    );
    // Cut by the end of the stream inside the last call: still a call.
    let input = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}";
    check(
        input,
        d,
        false,
        false,
        &[tc("a", "{}", "<｜tool▁call▁begin｜>a<｜tool▁sep｜>{}")],
    );
    // A partial begin tag at the end is released as text.
    check("x<｜tool▁ca", d, false, false, &[text("x<｜tool▁ca")]);
}

// ---- Kimi K2 --------------------------------------------------------------

#[test]
fn kimi_k2_calls() {
    let k = Some(Family::KimiK2);
    let body = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>";
    let input = format!("<think>go</think>Checking.<|tool_calls_section_begin|>{body}<|tool_calls_section_end|><|im_end|>");
    check(
        &input,
        k,
        true,
        false,
        &[
            reasoning("go"),
            text("Checking."),
            tc("get_weather", r#"{"city":"Paris"}"#, body),
        ],
    );
    // The singular spelling of the section tags.
    let input = format!("<|tool_call_section_begin|>{body}<|tool_call_section_end|>ok");
    check(
        &input,
        k,
        false,
        false,
        &[tc("get_weather", r#"{"city":"Paris"}"#, body), text("ok")],
    );
    // A section opened inside reasoning ends it.
    let input = format!("<think>go<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>");
    check(
        &input,
        k,
        true,
        false,
        &[
            reasoning("go"),
            tc("get_weather", r#"{"city":"Paris"}"#, body),
        ],
    );
}

// ---- Gemma 4 --------------------------------------------------------------

#[test]
fn gemma4_reasoning_and_calls() {
    let g = Some(Family::Gemma4);
    let body = "call:get_weather{location:<|\"|>Paris, <tool_call|> FR<|\"|>,days:3}";
    let input =
        format!("<|channel>thought\nhmm<channel|>Sure.<|tool_call>{body}<tool_call|><turn|>");
    let args = json!({"location": "Paris, <tool_call|> FR", "days": 3}).to_string();
    for r in [false, true] {
        check(
            &input,
            g,
            r,
            false,
            &[
                reasoning("hmm"),
                text("Sure."),
                tc("get_weather", &args, body),
            ],
        );
    }
    // The label only where it is the whole prefix.
    check(
        "<|channel>thoughtful<channel|>x",
        g,
        true,
        false,
        &[reasoning("thoughtful"), text("x")],
    );
    check("<|channel>though", g, true, false, &[reasoning("though")]);
    let bad = "<|tool_call>get_weather(city=1)<tool_call|>";
    check(bad, g, true, false, &[text(bad)]);
}

// ---- MiniMax M2 -----------------------------------------------------------

#[test]
fn minimax_m2_calls() {
    let m = Some(Family::MiniMaxM2);
    let body = "\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">2</parameter>\n</invoke>\n<invoke name=\"now\">\n</invoke>\n";
    let input =
        format!("<think>\nok\n</think>\n\nOn it.<minimax:tool_call>{body}</minimax:tool_call>");
    check(
        &input,
        m,
        true,
        false,
        &[
            reasoning("\nok\n"),
            text("On it."),
            tc("get_weather", r#"{"city":"Paris","days":2}"#, body),
            tc("now", "{}", ""),
        ],
    );
}

// ---- pythonic -------------------------------------------------------------

#[test]
fn pythonic_calls() {
    let p = Some(Family::Pythonic);
    let body = r#"[get_weather(city="San Francisco", days=3), now()]"#;
    check(
        body,
        p,
        false,
        false,
        &[
            tc("get_weather", r#"{"city":"San Francisco","days":3}"#, body),
            tc("now", "{}", ""),
        ],
    );
    // Brackets and tags inside strings; Llama 4's python tags; a list that is
    // not calls is text, and so is what follows.
    let body = "[w(code='a]) <|python_end|>')]";
    check(
        &format!("  {body}<|eot|>"),
        p,
        false,
        false,
        &[tc(
            "w",
            r#"{"code":"a]) "}"#,
            &format!("  {}", body.replace("<|python_end|>", "")),
        )],
    );
    check(
        "<|python_start|>[f(a=1)]<|python_end|>done",
        p,
        false,
        false,
        &[tc("f", r#"{"a":1}"#, "[f(a=1)]"), text("done")],
    );
    check(
        "[1, 2] are numbers [f()]",
        p,
        false,
        false,
        &[text("[1, 2] are numbers [f()]")],
    );
    check("Hi [f()]", p, false, false, &[text("Hi [f()]")]);
    check(
        "<think>x</think>\n[f()]",
        p,
        true,
        false,
        &[reasoning("x"), tc("f", "{}", "\n[f()]")],
    );
    check("[f(a=1", p, false, false, &[text("[f(a=1")]);
    check(
        "<|python_tag|>[f()]<|eom_id|>",
        p,
        false,
        false,
        &[tc("f", "{}", "[f()]")],
    );
}

// ---- properties -----------------------------------------------------------

/// Random cases per property test; `CAIRN_TEXT_CASES` raises it.
fn iterations() -> usize {
    std::env::var("CAIRN_TEXT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// Fragments of every new family's syntax, and of text that looks like it.
const ALPHABET: &[&str] = &[
    "a",
    " ",
    "\n",
    "<",
    ">",
    "|",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    "=",
    ",",
    ":",
    "\"",
    "'",
    "\\",
    "é",
    "🙂",
    "｜",
    "<think>",
    "</think>",
    "<|im_end|>",
    "<|endoftext|>",
    // harmony
    "<|start|>",
    "assistant",
    "<|channel|>",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    "<|constrain|>",
    "json",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|chan",
    // glm
    "<tool_call>",
    "</tool_call>",
    "f\n",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    // deepseek
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "function",
    "```json\n",
    "```",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁",
    // kimi
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "functions.f:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    // gemma
    "<|channel>",
    "thought\n",
    "<channel|>",
    "<|tool_call>",
    "call:f{",
    "<|\"|>",
    "<tool_call|>",
    "<turn|>",
    // minimax
    "<minimax:tool_call>",
    "</minimax:tool_call>",
    "<invoke name=\"f\">",
    "</invoke>",
    "<parameter name=\"p\">",
    "</parameter>",
    // pythonic
    "[f(p=1)]",
    "f(",
    "p=",
    "<|python_start|>",
    "<|python_end|>",
    "<|eot|>",
    // whole calls
    r#"{"p": 1}"#,
];

#[test]
fn random_inputs_are_chunking_invariant() {
    let mut rng = Rng(0x0f0f_1234_5678_9abc);
    for _ in 0..iterations() {
        let input = random_text(&mut rng, ALPHABET, 14);
        let family = *rng.pick(NEW);
        let r = rng.below(2) == 1;
        let sir = r && rng.below(3) == 0;
        let chunks = random_chunks(&input, &mut rng);
        let segs = stream(&input, &chunks, Some(family), r, sir);
        for s in &segs {
            match s {
                Segment::Text(t) | Segment::Reasoning(t) => assert!(!t.is_empty()),
                Segment::ToolCall(c) => {
                    assert!(!c.name.is_empty());
                    let v: serde_json::Value = serde_json::from_str(&c.arguments).unwrap();
                    assert!(v.is_object());
                }
            }
        }
    }
}

/// Argument text for the round-trip test: tag text, quotes, escapes.
const ARG_PIECES: &[&str] = &[
    "a",
    " ",
    "\n",
    "\t",
    "é",
    "🙂",
    "<",
    ">",
    "\"",
    "'",
    "\\",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ",",
    ":",
    "=",
    "</think>",
    "<think>",
    "</tool_call>",
    "</arg_value>",
    "<arg_key>",
    "</parameter>",
    "</invoke>",
    "<tool_call|>",
    "<|call|>",
    "<|end|>",
    "<|channel|>",
    "<｜tool▁calls▁end｜>",
    "<|tool_call_end|>",
    "<|python_end|>",
    "]",
    "1",
    "true",
];

#[test]
fn well_formed_calls_round_trip_under_any_chunking() {
    let schemas = r#"{"f": {"properties": {"p": {"type": "string"}}}}"#;
    let mut rng = Rng(0x5eed_cafe_f00d_0001);
    let mut tried = 0;
    while tried < iterations() {
        let s = random_text(&mut rng, ARG_PIECES, 10);
        let family = *rng.pick(NEW);
        let Some((input, want)) = well_formed(family, false, &s) else {
            continue;
        };
        tried += 1;
        let r = rng.below(2) == 1;
        let chunks = random_chunks(&input, &mut rng);
        let mut p = OutputParser::new(Some(family), r, false).unwrap();
        p.set_tool_schemas(ToolSchemas::from_json(schemas).unwrap());
        let mut segs = Vec::new();
        for c in &chunks {
            segs.extend(p.push(c));
        }
        segs.extend(p.flush());
        assert_eq!(
            OutputParser::coalesce(segs),
            want,
            "{family} input {input:?} chunks {chunks:?}"
        );
    }
}

#[test]
fn family_names_round_trip() {
    for f in Family::ALL {
        assert_eq!(f.name().parse::<Family>().unwrap(), f);
    }
    assert_eq!(Family::ALL.len(), Family::NAMES.len());
}

#[test]
fn parser_tags_list_what_each_parser_reads() {
    use cairn_text::{parser_tags, END_MARKERS};
    let has = |f: Family, reasoning: bool, t: &str| parser_tags(Some(f), reasoning).contains(&t);
    for (f, tags) in [
        (Family::Hermes, &["<tool_call>", "</tool_call>"][..]),
        (
            Family::Qwen3Coder,
            &["<tool_call>", "<function=", "</parameter>"][..],
        ),
        (Family::Llama3, &["<|python_tag|>"][..]),
        (
            Family::Mistral,
            &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"][..],
        ),
        (
            Family::Harmony,
            &[
                "<|start|>",
                "<|channel|>",
                "<|message|>",
                "<|constrain|>",
                "<|end|>",
            ][..],
        ),
        (
            Family::Glm45,
            &["<tool_call>", "<arg_key>", "</arg_value>"][..],
        ),
        (
            Family::DeepSeekV3,
            &[
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁sep｜>",
            ][..],
        ),
        (
            Family::KimiK2,
            &[
                "<|tool_calls_section_begin|>",
                "<|tool_call_argument_begin|>",
            ][..],
        ),
        (
            Family::Gemma4,
            &["<|tool_call>", "<tool_call|>", "<|\"|>", "<|channel>"][..],
        ),
        (
            Family::MiniMaxM2,
            &["<minimax:tool_call>", "<invoke name="][..],
        ),
        (
            Family::Pythonic,
            &["<|python_start|>", "<|python_end|>"][..],
        ),
    ] {
        for t in tags {
            assert!(has(f, false, t), "{f} {t}");
        }
        for m in END_MARKERS {
            assert!(has(f, false, m), "{f} {m}");
        }
    }
    // Reasoning tags only when reasoning is parsed (Gemma 4's always are).
    assert!(has(Family::Mistral, true, "[THINK]") && !has(Family::Mistral, false, "[THINK]"));
    assert!(has(Family::Glm45, true, "<think>") && !has(Family::Glm45, false, "<think>"));
    assert!(has(Family::Gemma4, false, "<channel|>"));
    assert!(!has(Family::Harmony, true, "<think>"));
    assert!(parser_tags(None, true).contains(&"</think>"));
    assert!(!parser_tags(None, false).contains(&"<tool_call>"));
}
