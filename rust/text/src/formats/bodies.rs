//! Section bodies of GLM-4.5, MiniMax M2, DeepSeek V3 / V3.1 and Kimi K2:
//! the text between the section's tags, turned into `(name, arguments)`.
//!
//! Every parser returns `None` for anything it does not fully understand,
//! so the raw text comes back as text.
use serde_json::{Map, Value};

use crate::schema::ToolSchemas;

/// Parsed `(name, arguments JSON)` pairs, or `None` for a malformed body.
pub(crate) type Calls = Option<Vec<(String, String)>>;

/// A tool name: non-empty, one line, no tag text.
pub(crate) fn name_ok(n: &str) -> bool {
    !n.is_empty() && !n.contains(['<', '>', '\n', '{', '}'])
}

/// `(name, args)` when the trimmed name is [`name_ok`].
fn named(name: &str, args: String) -> Option<(String, String)> {
    let name = name.trim();
    name_ok(name).then(|| (name.to_owned(), args))
}

/// A JSON object's compact text (`{}` for an empty body).
fn json_object(s: &str) -> Option<String> {
    let t = s.trim();
    if t.is_empty() {
        return Some("{}".to_owned());
    }
    match serde_json::from_str::<Value>(t).ok()? {
        v @ Value::Object(_) => Some(v.to_string()),
        _ => None,
    }
}

/// Calls one after another to the end of `body`, whitespace between: `one`
/// parses the call at the start of the (left-trimmed) text and returns it
/// with the text after it. At least one call.
pub(crate) fn repeated<'a>(
    body: &'a str,
    mut one: impl FnMut(&'a str) -> Option<((String, String), &'a str)>,
) -> Calls {
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (call, after) = one(rest)?;
        calls.push(call);
        rest = after.trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// Whether `s` is, after whitespace, empty or starts with one of `next`.
fn then(s: &str, next: &[&str]) -> bool {
    let t = s.trim_start();
    t.is_empty() || next.iter().any(|n| t.starts_with(n))
}

/// Splits `s` at the first `close` after which the structure can go on
/// (`cont` holds for what follows it): (value, rest after the tag). A
/// `close` followed by anything else is value text.
fn split_value<'a>(
    s: &'a str,
    close: &str,
    cont: impl Fn(&str) -> bool,
) -> Option<(&'a str, &'a str)> {
    let mut from = 0;
    while let Some(i) = s[from..].find(close) {
        let at = from + i;
        let after = &s[at + close.len()..];
        if cont(after) {
            return Some((&s[..at], after));
        }
        from = at + close.len();
    }
    None
}

// ---- GLM-4.5 / 4.7 ------------------------------------------------------

const ARG_KEY: &str = "<arg_key>";
const ARG_KEY_END: &str = "</arg_key>";
const ARG_VALUE: &str = "<arg_value>";
const ARG_VALUE_END: &str = "</arg_value>";
/// The tags inside a GLM call.
pub(crate) const GLM_TAGS: &[&str] = &[ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END];

/// `</tool_call>` ends a GLM call unless it falls inside a value: once an
/// `<arg_value>` opened, only right after `</arg_value>` (whitespace
/// between).
pub(crate) fn glm_closes(body: &str) -> bool {
    !body.contains(ARG_VALUE) || body.trim_end().ends_with(ARG_VALUE_END)
}

/// `NAME` then `<arg_key>K</arg_key>` `<arg_value>V</arg_value>` pairs
/// (whitespace between). A `</arg_value>` ends a value only where another
/// `<arg_key>` or the end of the body follows, so values round-trip unless
/// they hold exactly that.
pub(crate) fn parse_glm(body: &str, schemas: &ToolSchemas) -> Calls {
    let (name, mut rest) = match body.find(ARG_KEY) {
        Some(i) => (body[..i].trim(), &body[i..]),
        None => (body.trim(), ""),
    };
    if !name_ok(name) {
        return None;
    }
    let mut args = Map::new();
    loop {
        let t = rest.trim_start();
        if t.is_empty() {
            break;
        }
        let k = t.strip_prefix(ARG_KEY)?;
        let (key, after) = k.split_once(ARG_KEY_END)?;
        let key = key.trim();
        if key.is_empty() || key.contains('<') {
            return None;
        }
        let v = after.trim_start().strip_prefix(ARG_VALUE)?;
        let (value, after) = split_value(v, ARG_VALUE_END, |a| then(a, &[ARG_KEY]))?;
        args.insert(key.to_owned(), schemas.value(name, key, value));
        rest = after;
    }
    Some(vec![(name.to_owned(), Value::Object(args).to_string())])
}

// ---- MiniMax M2 -----------------------------------------------------------

const INVOKE: &str = "<invoke name=";
const INVOKE_END: &str = "</invoke>";
const PARAM: &str = "<parameter name=";
const PARAM_END: &str = "</parameter>";
/// The tags inside a MiniMax section.
pub(crate) const MINIMAX_TAGS: &[&str] = &[INVOKE, INVOKE_END, PARAM, PARAM_END];

/// `</minimax:tool_call>` ends the section unless it falls inside a value:
/// once a `<parameter` opened, only right after `</invoke>`.
pub(crate) fn minimax_closes(body: &str) -> bool {
    !body.contains(PARAM) || body.trim_end().ends_with(INVOKE_END)
}

/// `name="X">` (quotes optional): the name and what follows the `>`.
fn attr_name(s: &str) -> Option<(&str, &str)> {
    let (n, rest) = s.split_once('>')?;
    let n = n.trim();
    let n = n
        .strip_prefix('"')
        .and_then(|n| n.strip_suffix('"'))
        .unwrap_or(n);
    name_ok(n).then_some((n, rest))
}

/// What may follow `</invoke>`: another invoke or the end of the body.
fn invoke_end_ok(after: &str) -> bool {
    then(after, &[INVOKE])
}

/// `<invoke name="N">` with `<parameter name="K">V</parameter>`s then
/// `</invoke>`, once or more. One newline at each end of a value is layout.
pub(crate) fn parse_minimax(body: &str, schemas: &ToolSchemas) -> Calls {
    repeated(body, |t| {
        let (name, mut r) = attr_name(t.strip_prefix(INVOKE)?)?;
        let mut args = Map::new();
        loop {
            let t = r.trim_start();
            if let Some(after) = t.strip_prefix(INVOKE_END) {
                if !invoke_end_ok(after) {
                    return None;
                }
                r = after;
                break;
            }
            let (key, v) = attr_name(t.strip_prefix(PARAM)?)?;
            let cont = |a: &str| {
                let a = a.trim_start();
                a.starts_with(PARAM) || a.strip_prefix(INVOKE_END).is_some_and(invoke_end_ok)
            };
            let (value, after) = split_value(v, PARAM_END, cont)?;
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            args.insert(key.to_owned(), schemas.value(name, key, value));
            r = after;
        }
        Some(((name.to_owned(), Value::Object(args).to_string()), r))
    })
}

// ---- DeepSeek V3 / V3.1 -------------------------------------------------

pub(crate) const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub(crate) const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
/// The tags inside a DeepSeek section.
pub(crate) const DS_TAGS: &[&str] = &[DS_CALL_BEGIN, DS_CALL_END, DS_SEP];

/// Calls `<｜tool▁call▁begin｜>..<｜tool▁call▁end｜>`, whitespace between;
/// the last may be cut by the end of the stream. Each is V3's
/// `function<｜tool▁sep｜>NAME\n```json\n{..}\n```` or V3.1's
/// `NAME<｜tool▁sep｜>{..}`.
pub(crate) fn parse_deepseek(body: &str, _: &ToolSchemas) -> Calls {
    each_call(body, DS_CALL_BEGIN, DS_CALL_END, |inner| {
        let (head, tail) = inner.split_once(DS_SEP)?;
        let t = tail.trim_start();
        if head.trim() == "function" && !t.starts_with('{') {
            // V3: the name on the first line, then a fenced JSON block.
            let (name, fenced) = t.split_once('\n')?;
            let j = fenced.trim();
            let j = j
                .strip_prefix("```json")
                .or_else(|| j.strip_prefix("```"))?;
            let j = j.strip_suffix("```")?;
            return named(name, json_object(j)?);
        }
        named(head, json_object(tail)?)
    })
}

// ---- Kimi K2 --------------------------------------------------------------

const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
/// The tags inside a Kimi section.
pub(crate) const KIMI_TAGS: &[&str] = &[KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS];

/// Calls `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{..}<|tool_call_end|>`.
/// The name is the id without its `functions.` prefix and `:IDX` suffix.
pub(crate) fn parse_kimi(body: &str, _: &ToolSchemas) -> Calls {
    each_call(body, KIMI_CALL_BEGIN, KIMI_CALL_END, |inner| {
        let (id, args) = inner.split_once(KIMI_ARGS)?;
        let id = id.trim();
        let id = match id.rsplit_once(':') {
            Some((n, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => id,
        };
        named(
            id.strip_prefix("functions.").unwrap_or(id),
            json_object(args)?,
        )
    })
}

/// `begin inner end` repeated with whitespace between; the last `end` may
/// be missing (the stream ended). At least one call.
fn each_call(
    body: &str,
    begin: &str,
    end: &str,
    one: impl Fn(&str) -> Option<(String, String)>,
) -> Calls {
    repeated(body, |t| {
        let t = t.strip_prefix(begin)?;
        let (inner, after) = match t.find(end) {
            Some(i) => (&t[..i], &t[i + end.len()..]),
            None => (t, ""),
        };
        Some((one(inner)?, after))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(calls: Calls) -> (String, String) {
        let mut c = calls.expect("parses");
        assert_eq!(c.len(), 1);
        c.remove(0)
    }

    /// The two calls of the DeepSeek and Kimi examples.
    fn weather_then_now(calls: Calls) {
        assert_eq!(
            calls.unwrap(),
            vec![
                ("get_weather".into(), r#"{"city":"Paris"}"#.into()),
                ("now".into(), "{}".into())
            ]
        );
    }

    /// Every body in `bad` is malformed.
    fn rejects(parse: fn(&str, &ToolSchemas) -> Calls, bad: &[&str]) {
        for b in bad {
            assert!(parse(b, &ToolSchemas::default()).is_none(), "{b:?}");
        }
    }

    #[test]
    fn glm() {
        let none = ToolSchemas::default();
        let body = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n";
        assert_eq!(
            one(parse_glm(body, &none)),
            (
                "get_weather".into(),
                r#"{"city":"Beijing","days":3}"#.into()
            )
        );
        // GLM-4.7: no newline after the name; no arguments at all.
        let c = one(parse_glm(
            "f<arg_key>a</arg_key><arg_value>[1]</arg_value>",
            &none,
        ));
        assert_eq!(c.1, r#"{"a":[1]}"#);
        assert_eq!(one(parse_glm("\nnow\n", &none)).1, "{}");
        // A string parameter keeps its text, even when it looks like JSON.
        let s =
            ToolSchemas::from_json(r#"{"f": {"properties": {"a": {"type": "string"}}}}"#).unwrap();
        let c = one(parse_glm(
            "f<arg_key>a</arg_key><arg_value> 12</arg_value>",
            &s,
        ));
        assert_eq!(c.1, r#"{"a":" 12"}"#);
        // Tag text inside a value.
        let v = "x</arg_value>y<arg_key>z";
        let c = one(parse_glm(
            &format!("f<arg_key>a</arg_key><arg_value>{v}</arg_value>"),
            &none,
        ));
        assert_eq!(c.1, serde_json::json!({ "a": v }).to_string());
        rejects(
            parse_glm,
            &[
                "",
                "f<arg_key>a</arg_key>",
                "f<arg_key>a</arg_key><arg_value>1",
                "a b<c",
            ],
        );
        assert!(glm_closes(
            "f<arg_key>a</arg_key><arg_value>1</arg_value>\n"
        ));
        assert!(!glm_closes("f<arg_key>a</arg_key><arg_value>1"));
        assert!(glm_closes("f\n"));
    }

    #[test]
    fn minimax() {
        let none = ToolSchemas::default();
        let body = "\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">2</parameter>\n</invoke>\n<invoke name=\"now\">\n</invoke>\n";
        let c = parse_minimax(body, &none).unwrap();
        assert_eq!(
            c,
            vec![
                ("get_weather".into(), r#"{"city":"Paris","days":2}"#.into()),
                ("now".into(), "{}".into())
            ]
        );
        let v = "a</parameter>b</invoke>c";
        let body = format!("<invoke name=\"f\"><parameter name=\"p\">\n{v}\n</parameter></invoke>");
        assert_eq!(
            one(parse_minimax(&body, &none)).1,
            serde_json::json!({ "p": v }).to_string()
        );
        rejects(
            parse_minimax,
            &[
                "",
                "<invoke name=\"f\">",
                "<invoke name=\"\"></invoke>",
                "<invoke name=\"f\"></invoke> x",
            ],
        );
    }

    #[test]
    fn deepseek() {
        let none = ToolSchemas::default();
        let v3 = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>";
        weather_then_now(parse_deepseek(v3, &none));
        let v31 = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>";
        assert_eq!(one(parse_deepseek(v31, &none)).0, "get_weather");
        // A V3.1 call to a tool named `function`.
        let f = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{\"a\": 1}";
        assert_eq!(
            one(parse_deepseek(f, &none)),
            ("function".into(), r#"{"a":1}"#.into())
        );
        rejects(
            parse_deepseek,
            &[
                "",
                "x",
                "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]",
                "<｜tool▁call▁begin｜>f{}",
            ],
        );
    }

    #[test]
    fn kimi() {
        let none = ToolSchemas::default();
        let body = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>";
        weather_then_now(parse_kimi(body, &none));
        assert_eq!(
            one(parse_kimi(
                "<|tool_call_begin|>search<|tool_call_argument_begin|>{}",
                &none
            ))
            .0,
            "search"
        );
        rejects(parse_kimi, &["<|tool_call_begin|>functions.f:0{}"]);
    }
}
