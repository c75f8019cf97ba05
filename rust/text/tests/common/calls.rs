//! A well-formed call to `f` whose argument `p` is arbitrary text, in each
//! family's syntax: what the round-trip tests and the fuzz targets send, and
//! the segments it must parse to. The fuzz crate includes this file with
//! `#[path]`, so it uses nothing but `cairn_text` and `serde_json`.
use cairn_text::{Family, Segment, ToolCall, END_MARKERS};
use serde_json::{json, Value};

/// The call to `f` with these arguments, written as `raw`.
fn call_f(args: &str, raw: &str) -> Segment {
    Segment::ToolCall(ToolCall {
        name: "f".into(),
        arguments: args.into(),
        raw: raw.into(),
    })
}

/// `s` as a Python string literal.
pub fn python_str(s: &str) -> String {
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

/// Whether a Qwen3-Coder value holds text its closing rule reads as
/// structure (`</parameter>` then `<parameter=`, or `</function>` then
/// `</tool_call>`, whitespace between; see `parse_xml_function`): such a
/// value cannot round-trip.
fn xml_ambiguous(v: &str) -> bool {
    let followed = |tag: &str, next: &str| {
        v.match_indices(tag)
            .any(|(i, _)| v[i + tag.len()..].trim_start().starts_with(next))
    };
    followed("</parameter>", "<parameter=") || followed("</function>", "</tool_call>")
}

/// Whether `s` can be an argument's text in `family`'s syntax. Markers are
/// dropped even inside strings, so the call would differ; in the
/// special-token formats their tokens cannot be argument text either. (A
/// Qwen3-Coder XML value has a rule of its own: see [`section`].)
pub fn writable(family: Family, s: &str) -> bool {
    let has = |tags: &[&str]| tags.iter().any(|m| s.contains(m));
    let not = |tags: &[&str]| !has(tags);
    !has(END_MARKERS)
        && match family {
            Family::Harmony => not(&[
                "<|call|>",
                "<|end|>",
                "<|channel|>",
                "<|start|>",
                "<|return|>",
                "<|message|>",
                "<|constrain|>",
            ]),
            // A value holding `</arg_value>` then `<arg_key>` (or
            // `</tool_call>`) is read as structure.
            Family::Glm45 => not(&[
                "</arg_value>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
                "<|system|>",
            ]),
            Family::DeepSeekV3 => not(&[
                "<｜tool▁calls▁end｜>",
                "<｜tool▁call▁end｜>",
                "<｜end▁of▁sentence｜>",
                "<｜begin▁of▁sentence｜>",
                "<｜Assistant｜>",
                "<｜User｜>",
            ]),
            Family::KimiK2 => not(&[
                "<|tool_calls_section_end|>",
                "<|tool_call_end|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|im_system|>",
                "<|im_middle|>",
                "<|tool_call_section_end|>",
            ]),
            Family::Gemma4 => not(&[
                "<|\"|>",
                "<|turn>",
                "<turn|>",
                "<|tool_response>",
                "<tool_response|>",
                "<eos>",
                "<bos>",
                "<|think|>",
            ]),
            Family::MiniMaxM2 => {
                // `</invoke>` then `</minimax:tool_call>` (whitespace
                // between) in a value reads as the section's end.
                let ends = s
                    .match_indices("</invoke>")
                    .any(|(i, _)| s[i + 9..].trim_start().starts_with("</minimax:tool_call>"));
                !ends && not(&["</parameter>", "]~b]", "]~!b[", "[e~["])
            }
            // Markers inside a bare list are dropped, so a `<` may not survive.
            Family::Pythonic => !s.contains('<'),
            Family::Hermes | Family::Qwen3Coder | Family::Llama3 | Family::Mistral => true,
        }
}

/// A call to `f` with argument `p` = `s` in a family whose calls are tagged
/// sections (Qwen3-Coder: its XML form): the opening tag, the body (the
/// call's raw text) and the closing tag. `None` for the other families or
/// where `s` cannot be written.
pub fn section(family: Family, s: &str) -> Option<(&'static str, String, &'static str)> {
    if !writable(family, s) {
        return None;
    }
    let args = json!({ "p": s }).to_string();
    Some(match family {
        Family::Hermes => (
            "<tool_call>",
            json!({"name": "f", "arguments": {"p": s}}).to_string(),
            "</tool_call>",
        ),
        Family::Qwen3Coder => {
            if xml_ambiguous(s) {
                return None;
            }
            let body = format!("\n<function=f>\n<parameter=p>\n{s}\n</parameter>\n</function>\n");
            ("<tool_call>", body, "</tool_call>")
        }
        Family::Glm45 => {
            let body = format!("f\n<arg_key>p</arg_key>\n<arg_value>{s}</arg_value>\n");
            ("<tool_call>", body, "</tool_call>")
        }
        Family::DeepSeekV3 => (
            "<｜tool▁calls▁begin｜>",
            format!("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
            "<｜tool▁calls▁end｜>",
        ),
        Family::KimiK2 => (
            "<|tool_calls_section_begin|>",
            format!(
                "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{args}<|tool_call_end|>"
            ),
            "<|tool_calls_section_end|>",
        ),
        Family::Gemma4 => (
            "<|tool_call>",
            format!("call:f{{p:<|\"|>{s}<|\"|>}}"),
            "<tool_call|>",
        ),
        // One newline at each end of a value is layout.
        Family::MiniMaxM2 => (
            "<minimax:tool_call>",
            format!("\n<invoke name=\"f\">\n<parameter name=\"p\">\n{s}\n</parameter>\n</invoke>\n"),
            "</minimax:tool_call>",
        ),
        _ => return None,
    })
}

/// A call to `f` with argument `p` = `s` in `family`'s syntax (`form` picks
/// between the two shapes of Qwen3-Coder, Llama 3 and Mistral): the model
/// text and the segments it must parse to (for GLM-4.5 and MiniMax M2, with
/// tool schemas that make `p` a string). `None` where `s` cannot be written
/// there.
pub fn well_formed(family: Family, form: bool, s: &str) -> Option<(String, Vec<Segment>)> {
    if !writable(family, s) {
        return None;
    }
    let args = json!({ "p": s }).to_string();
    let obj = |key: &str| json!({"name": "f", key: {"p": s}}).to_string();
    let t = |x: &str| Segment::Text(x.into());
    // A tagged section between "Hi " and "bye".
    let wrapped = |family: Family, args: &str| {
        let (open, body, close) = section(family, s)?;
        Some((
            format!("Hi {open}{body}{close} bye"),
            vec![t("Hi "), call_f(args, &body), t("bye")],
        ))
    };
    match (family, form) {
        (Family::Hermes, _) | (Family::Qwen3Coder, false) => wrapped(Family::Hermes, &args),
        (Family::Qwen3Coder, true) => {
            // The value is JSON where it reads as JSON (no schemas).
            let v = serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s));
            wrapped(family, &json!({ "p": v }).to_string())
        }
        (Family::Llama3, false) => {
            let body = obj("parameters");
            Some((
                format!("<|python_tag|>{body}<|eom_id|>"),
                vec![call_f(&args, &body)],
            ))
        }
        (Family::Llama3, true) => {
            let body = obj("parameters");
            Some((body.clone(), vec![call_f(&args, &body)]))
        }
        (Family::Mistral, _) => {
            let body = if form {
                format!("f[ARGS]{args}")
            } else {
                format!("[{}]", obj("arguments"))
            };
            Some((
                format!("Hi [TOOL_CALLS]{body}"),
                vec![t("Hi "), call_f(&args, &body)],
            ))
        }
        (Family::Harmony, _) => {
            let input = format!("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|><|start|>assistant<|channel|>final<|message|>bye");
            Some((input, vec![call_f(&args, &args), t("bye")]))
        }
        (Family::Pythonic, _) => {
            let body = format!("[f(p={})]", python_str(s));
            Some((format!("{body} bye"), vec![call_f(&args, &body), t("bye")]))
        }
        _ => wrapped(family, &args),
    }
}
