//! Turns the body of a tool call into calls, or says it is malformed.
//!
//! Every parser returns `None` for anything it does not fully understand,
//! so the caller can hand the raw text back as text.
use serde_json::{Map, Value};

use crate::ToolCall;

/// A call object: `{"name": .., "arguments" | "parameters": {..}}`, also
/// wrapped as `{"function": {..}}`. `arguments` may be an object, a string
/// holding a JSON object, or absent/null (`{}`).
fn call_from_value(v: &Value) -> Option<(String, String)> {
    let obj = v.as_object()?;
    let obj = match obj.get("function") {
        Some(Value::Object(f)) if !obj.contains_key("name") => f,
        _ => obj,
    };
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a.to_string(),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name.to_owned(), args))
}

fn calls(raw: &str, found: Vec<(String, String)>) -> Vec<ToolCall> {
    // The first call of a body carries the body's raw text, so that the raw
    // texts of all segments still add up to the model's output.
    found
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| ToolCall {
            name,
            arguments,
            raw: if i == 0 {
                raw.to_owned()
            } else {
                String::new()
            },
        })
        .collect()
}

/// One JSON call object, surrounded by optional whitespace.
pub(crate) fn parse_json_call(body: &str) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(body).ok()?;
    Some(calls(body, vec![call_from_value(&v)?]))
}

/// What a `<tool_call>` body holds, judged by how it starts. Decides which
/// closing rule [`tagged_close_ends`] applies while the body streams in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    /// Hermes JSON: starts with `{`. The parser tracks its strings.
    Json,
    /// Qwen3-Coder: starts with `<function=`. Values are raw text.
    Xml,
    /// Anything else (so far): malformed, or too short to tell.
    Other,
}

/// The kind of `body`, from its first non-whitespace text.
pub(crate) fn body_kind(body: &str) -> BodyKind {
    let t = body.trim_start();
    if t.starts_with('{') {
        BodyKind::Json
    } else if t.starts_with(FN_OPEN) {
        BodyKind::Xml
    } else {
        BodyKind::Other
    }
}

/// A body inside `<tool_call>`: JSON (Hermes) or `<function=..>` (Qwen3-Coder).
pub(crate) fn parse_tagged_body(body: &str) -> Option<Vec<ToolCall>> {
    match body_kind(body) {
        BodyKind::Xml => {
            let (name, args) = parse_xml_function(body.trim())?;
            Some(calls(body, vec![(name, args)]))
        }
        _ => parse_json_call(body),
    }
}

const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// The tags inside a Qwen3-Coder call.
pub(crate) const XML_TAGS: &[&str] = &[FN_OPEN, FN_CLOSE, PARAM_OPEN, PARAM_CLOSE];
pub(crate) const MISTRAL_ARGS: &str = "[ARGS]";
pub(crate) const MISTRAL_CALL_ID: &str = "[CALL_ID]";

/// Whether a `</tool_call>` that follows `body` (seen outside any JSON
/// string) closes the call.
///
/// Qwen3-Coder values are raw text and may themselves contain
/// `</tool_call>` (code that writes tool calls). Once a `<parameter=` has
/// opened, the call is closed only by a `</tool_call>` right after
/// `</function>` (whitespace between): the structural `</function>` of
/// [`parse_xml_function`]. Before any parameter there is no value to be
/// inside, so `</tool_call>` always closes (a malformed call then comes back
/// as text). JSON and other bodies close at the first `</tool_call>` the
/// parser sees; it never looks inside JSON strings.
pub(crate) fn tagged_close_ends(body: &str) -> bool {
    body_kind(body) != BodyKind::Xml
        || !body.contains(PARAM_OPEN)
        || body.trim_end().ends_with(FN_CLOSE)
}

/// `s` is optional whitespace then `</function>` then optional whitespace.
fn is_function_end(s: &str) -> bool {
    s.trim_start()
        .strip_prefix(FN_CLOSE)
        .is_some_and(|r| r.trim_start().is_empty())
}

/// `<function=NAME>` then `<parameter=P>value</parameter>`* then `</function>`,
/// where `s` is the body without the enclosing `<tool_call>` tags.
///
/// Values are raw text and may contain any of these tags, so a closing tag
/// counts only where the structure can continue after it:
/// - `</function>` only when just whitespace follows it to the end of the
///   body (that is, before `</tool_call>` or the end of the stream);
/// - `</parameter>` only when, after optional whitespace, `<parameter=` or
///   such a final `</function>` follows; a value missing its `</parameter>`
///   runs to the final `</function>`.
///
/// Any other tag text is part of the value, so a value round-trips exactly
/// unless it contains `</parameter>` followed by whitespace and
/// `<parameter=`, or `</function>` followed by whitespace and `</tool_call>`
/// (text that cannot be told from structure). Values are JSON when they
/// parse as JSON, else strings; one leading and one trailing newline around
/// a value belong to the format and are dropped.
fn parse_xml_function(s: &str) -> Option<(String, String)> {
    let rest = s.strip_prefix(FN_OPEN)?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut rest = &rest[gt + 1..];
    let mut args = Map::new();
    loop {
        if is_function_end(rest) {
            return Some((name.to_owned(), Value::Object(args).to_string()));
        }
        let p = rest.trim_start().strip_prefix(PARAM_OPEN)?;
        let gt = p.find('>')?;
        let pname = p[..gt].trim();
        if pname.is_empty() || pname.contains('<') {
            return None;
        }
        let (value, next) = split_value(&p[gt + 1..])?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let v = serde_json::from_str::<Value>(value)
            .unwrap_or_else(|_| Value::String(value.to_owned()));
        args.insert(pname.to_owned(), v);
        rest = next;
    }
}

/// Splits a parameter's text into its value and what follows the value's
/// end (after `</parameter>`, or at the final `</function>`).
fn split_value(p: &str) -> Option<(&str, &str)> {
    let mut from = 0;
    while let Some(i) = p[from..].find(PARAM_CLOSE) {
        let at = from + i;
        let after = &p[at + PARAM_CLOSE.len()..];
        let t = after.trim_start();
        if t.starts_with(PARAM_OPEN) || is_function_end(t) {
            return Some((&p[..at], after));
        }
        from = at + PARAM_CLOSE.len();
    }
    let value = p.trim_end().strip_suffix(FN_CLOSE)?;
    Some((value, &p[value.len()..]))
}

/// Llama 3: one or more JSON call objects separated by `;` and whitespace.
pub(crate) fn parse_llama(body: &str) -> Option<Vec<ToolCall>> {
    let mut found = Vec::new();
    let mut rest = body;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace() || c == ';');
        if rest.is_empty() {
            break;
        }
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = it.next()?.ok()?;
        found.push(call_from_value(&v)?);
        rest = &rest[it.byte_offset()..];
    }
    (!found.is_empty()).then(|| calls(body, found))
}

/// Whether an unfinished Llama 3 bare JSON reply already looks like a call
/// (the shape [`parse_llama`] reads): an object whose first key is `"name"`
/// or `"function"`, after any `;` and whitespace. Other JSON
/// (`{"answer": ..`) may be the answer itself.
///
/// A key is only a key once its closing quote is there: `{"na` could still
/// be `{"nature": ..`.
pub(crate) fn looks_like_llama_call(body: &str) -> bool {
    fn ws(s: &str) -> &str {
        s.trim_start_matches(|c: char| c.is_ascii_whitespace())
    }
    // After a call the body starts with the `;` that separates calls.
    body.trim_start_matches(|c: char| c.is_ascii_whitespace() || c == ';')
        .strip_prefix('{')
        .map(ws)
        .is_some_and(|r| r.starts_with("\"name\"") || r.starts_with("\"function\""))
}

/// Mistral: a JSON array of calls (or one call object), or the newer
/// `name[ARGS]{json}` / `name[CALL_ID]id[ARGS]{json}` form.
pub(crate) fn parse_mistral(body: &str) -> Option<Vec<ToolCall>> {
    let t = body.trim();
    if t.starts_with('[') {
        let v: Value = serde_json::from_str(t).ok()?;
        let found = v
            .as_array()?
            .iter()
            .map(call_from_value)
            .collect::<Option<Vec<_>>>()?;
        return (!found.is_empty()).then(|| calls(body, found));
    }
    if t.starts_with('{') {
        return parse_json_call(body);
    }
    let (head, args) = t.split_once(MISTRAL_ARGS)?;
    let name = head
        .split_once(MISTRAL_CALL_ID)
        .map_or(head, |(n, _)| n)
        .trim();
    if name.is_empty() || name.contains(['[', '{', '<']) {
        return None;
    }
    let v: Value = serde_json::from_str(args).ok()?;
    if !v.is_object() {
        return None;
    }
    Some(calls(body, vec![(name.to_owned(), v.to_string())]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_call_shapes() {
        let c = parse_json_call(r#"{"name": "f", "arguments": {"a": 1, "b": [2]}}"#).unwrap();
        assert_eq!(
            (c[0].name.as_str(), c[0].arguments.as_str()),
            ("f", r#"{"a":1,"b":[2]}"#)
        );
        let c = parse_json_call(r#" {"name": "f", "arguments": "{\"a\": 1}"} "#).unwrap();
        assert_eq!(c[0].arguments, r#"{"a":1}"#);
        let c = parse_json_call(r#"{"name": "f"}"#).unwrap();
        assert_eq!(c[0].arguments, "{}");
        let c = parse_json_call(r#"{"function": {"name": "g", "parameters": {"z": 0, "a": 1}}}"#)
            .unwrap();
        assert_eq!(
            (c[0].name.as_str(), c[0].arguments.as_str()),
            ("g", r#"{"z":0,"a":1}"#)
        );
        for bad in [
            r#"{"arguments": {}}"#,
            r#"{"name": ""}"#,
            r#"{"name": 3}"#,
            r#"{"name": "f", "arguments": [1]}"#,
            r#"{"name": "f", "arguments": "x"}"#,
            "{",
            "[]",
            "",
        ] {
            assert!(parse_json_call(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn qwen3_coder_body() {
        let body = "\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n";
        let c = parse_tagged_body(body).unwrap();
        assert_eq!(c[0].name, "get_weather");
        assert_eq!(
            c[0].arguments,
            r#"{"city":"New York","days":3,"opts":{"unit":"C"}}"#
        );
        assert_eq!(c[0].raw, body);
        // A missing </parameter> runs to the final </function>; a
        // <parameter= inside a value is value text.
        let c =
            parse_tagged_body("<function=f><parameter=a>x<parameter=b>true</function>\n").unwrap();
        assert_eq!(c[0].arguments, r#"{"a":"x<parameter=b>true"}"#);
        let c = parse_tagged_body("<function=f></function>").unwrap();
        assert_eq!(c[0].arguments, "{}");
        for bad in [
            "<function=f>",
            "<function=>x</function>",
            "<function=f><parameter=a>1</parameter>",
            "<function=f></function> tail",
        ] {
            assert!(parse_tagged_body(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn qwen3_coder_tags_inside_values() {
        let args = |body: &str| parse_tagged_body(body).map(|c| c[0].arguments.clone());
        let v = "a</parameter>b</function>c</tool_call>d<parameter=e";
        let body = format!("<function=f>\n<parameter=code>\n{v}\n</parameter>\n</function>\n");
        assert_eq!(
            args(&body).unwrap(),
            serde_json::json!({ "code": v }).to_string()
        );
        // </parameter> then </function> that is not final: still the value.
        let body = "<function=f><parameter=a>x</parameter></function>y</parameter></function>";
        assert_eq!(args(body).unwrap(), r#"{"a":"x</parameter></function>y"}"#);
        let body = "<function=f><parameter=a>1</parameter> <parameter=b>2</parameter></function>";
        assert_eq!(args(body).unwrap(), r#"{"a":1,"b":2}"#);
        // The ambiguous case the rule documents: structure wins.
        let body = "<function=f><parameter=a>x</parameter><parameter=b>y</parameter></function>";
        assert_eq!(args(body).unwrap(), r#"{"a":"x","b":"y"}"#);
        assert!(args("<function=f><parameter=a>x</parameter>").is_none());
        assert!(args("<function=f><parameter=a>x</function> y").is_none());
    }

    #[test]
    fn when_tool_close_ends_a_body() {
        for (body, ends) in [
            ("", true),
            (r#"{"name": "f"}"#, true),
            ("<function=f>", true),
            ("<function=f>\n</function>\n", true),
            ("<function=f><parameter=a>x", false),
            ("<function=f><parameter=a>x</parameter>\n", false),
            ("<function=f><parameter=a>x</parameter></function> \n", true),
            ("hello", true),
        ] {
            assert_eq!(tagged_close_ends(body), ends, "{body:?}");
        }
    }

    #[test]
    fn llama_and_mistral() {
        let c = parse_llama(
            r#"{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}"#,
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[1].name.as_str(), c[1].raw.as_str()), ("b", ""));
        assert!(parse_llama("brave_search.call(query=\"x\")").is_none());
        assert!(parse_llama(r#"{"name": "a"} trailing"#).is_none());
        let c = parse_mistral(
            r#"[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]"#,
        )
        .unwrap();
        assert_eq!((c.len(), c[0].arguments.as_str()), (2, r#"{"x":1}"#));
        let c = parse_mistral(r#"get_weather[ARGS]{"city": "Paris"}"#).unwrap();
        assert_eq!(
            (c[0].name.as_str(), c[0].arguments.as_str()),
            ("get_weather", r#"{"city":"Paris"}"#)
        );
        let c = parse_mistral(r#"f[CALL_ID]abc123[ARGS]{}"#).unwrap();
        assert_eq!(c[0].name, "f");
        assert!(parse_mistral("[]").is_none());
        assert!(parse_mistral("hello").is_none());
    }
}
