//! Pythonic tool calls (Llama 3.2 / 4, vLLM's `pythonic` parser): a reply
//! that is a Python list of calls with keyword arguments,
//! `[get_weather(city="Paris", days=3), now()]`, optionally inside Llama 4's
//! `<|python_start|>..<|python_end|>`.
//!
//! A `[` that opens the reply (only whitespace, reasoning or calls before
//! it) starts a candidate list; it is collected to the bracket that closes
//! it (brackets inside Python strings do not count) and parsed. A list that
//! is not calls (`[1, 2] are...`) is text, and so is everything after it.
use std::mem::take;

use serde_json::{Map, Number, Value};

use super::cursor::Cursor;
use super::{markers, Machine, Out, Tags};

const PY_START: &str = "<|python_start|>";
const PY_END: &str = "<|python_end|>";
/// The tags the parser reads besides its markers.
pub(crate) const TAGS: &[&str] = &[PY_START, PY_END];
/// Llama 4's end-of-turn markers, and Llama 3's `<|python_tag|>`: dropped, so
/// the list after it opens the reply.
pub(crate) const LLAMA_MARKERS: &[&str] = &[
    "<|eot|>",
    "<|eom|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|python_tag|>",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tok {
    PyStart,
    PyEnd,
    ThinkOpen,
    ThinkClose,
    Marker,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Reasoning,
    /// A bare `[..]` at the start of the reply.
    List,
    /// After `<|python_start|>`.
    Tagged,
}

/// Bracket depth and Python string state of a list being collected.
#[derive(Debug, Clone, Default)]
struct Scan {
    depth: u32,
    quote: Option<u8>,
    esc: bool,
}

impl Scan {
    /// Feeds one byte; true when it closes the outermost bracket.
    fn feed(&mut self, b: u8) -> bool {
        if let Some(q) = self.quote {
            if self.esc {
                self.esc = false;
            } else if b == b'\\' {
                self.esc = true;
            } else if b == q {
                self.quote = None;
            }
            return false;
        }
        match b {
            b'\'' | b'"' => self.quote = Some(b),
            b'[' | b'(' | b'{' => self.depth += 1,
            b']' | b')' | b'}' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Pythonic {
    starts_in_reasoning: bool,
    text_tags: Tags<Tok>,
    reasoning_tags: Tags<Tok>,
    body_tags: Tags<Tok>,
    mode: Mode,
    /// No visible text yet: a `[` may open calls.
    detect: bool,
    /// Whitespace held while `detect` is set.
    pending: String,
    body: String,
    scan: Scan,
}

impl Pythonic {
    pub fn new(reasoning: bool, starts_in_reasoning: bool) -> Self {
        let mk = |think: bool, py: bool| {
            let mut v = markers(LLAMA_MARKERS, &[], Tok::Marker);
            if think {
                v.extend([("<think>", Tok::ThinkOpen), ("</think>", Tok::ThinkClose)]);
            }
            if py {
                v.extend([(PY_START, Tok::PyStart), (PY_END, Tok::PyEnd)]);
            }
            Tags::new(v)
        };
        let mut p = Pythonic {
            starts_in_reasoning,
            text_tags: mk(reasoning, true),
            reasoning_tags: mk(true, false),
            body_tags: mk(false, true),
            mode: Mode::Text,
            detect: true,
            pending: String::new(),
            body: String::new(),
            scan: Scan::default(),
        };
        p.reset();
        p
    }

    fn text(&mut self, s: &str, out: &mut Out) -> usize {
        let mut i = 0;
        if self.detect {
            let b = s.as_bytes();
            while i < b.len() && b[i].is_ascii_whitespace() {
                i += 1;
            }
            self.pending.push_str(&s[..i]);
            if i == b.len() {
                return i;
            }
            if b[i] == b'[' {
                self.mode = Mode::List;
                self.body = take(&mut self.pending);
                self.scan = Scan::default();
                return i;
            }
            out.text(&take(&mut self.pending));
            self.detect = false;
        }
        out.text(&s[i..]);
        s.len()
    }

    fn list(&mut self, s: &str, out: &mut Out) -> usize {
        for (i, &b) in s.as_bytes().iter().enumerate() {
            if self.scan.feed(b) {
                self.body.push_str(&s[..=i]);
                self.mode = Mode::Text;
                let body = take(&mut self.body);
                match parse_calls(body.trim()) {
                    Some(calls) => out.calls(&body, calls),
                    None => {
                        self.detect = false;
                        out.malformed(&[&body]);
                    }
                }
                return i + 1;
            }
        }
        self.body.push_str(s);
        s.len()
    }

    fn finish_tagged(&mut self, closed: bool, out: &mut Out) {
        self.mode = Mode::Text;
        let body = take(&mut self.body);
        let t = body.trim();
        let calls = if t.starts_with('[') {
            parse_calls(t)
        } else {
            parse_calls(&format!("[{t}]"))
        };
        match calls {
            Some(calls) => out.calls(&body, calls),
            None => {
                self.detect = false;
                out.malformed(&[PY_START, &body, if closed { PY_END } else { "" }]);
            }
        }
    }
}

impl Machine for Pythonic {
    type Tok = Tok;

    fn tags(&self) -> &Tags<Tok> {
        match self.mode {
            Mode::Text => &self.text_tags,
            Mode::Reasoning => &self.reasoning_tags,
            Mode::List | Mode::Tagged => &self.body_tags,
        }
    }

    fn content(&mut self, s: &str, out: &mut Out) -> usize {
        match self.mode {
            Mode::Text => self.text(s, out),
            Mode::Reasoning => {
                out.reasoning(s);
                s.len()
            }
            Mode::List => self.list(s, out),
            Mode::Tagged => {
                self.body.push_str(s);
                s.len()
            }
        }
    }

    fn tag(&mut self, t: Tok, out: &mut Out) {
        match (self.mode, t) {
            (Mode::Text, Tok::ThinkOpen) => {
                self.pending.clear();
                self.mode = Mode::Reasoning;
            }
            (Mode::Reasoning, Tok::ThinkClose) => {
                self.mode = Mode::Text;
                out.trim = true;
            }
            (Mode::Text, Tok::PyStart) => {
                self.pending.clear();
                self.body.clear();
                self.mode = Mode::Tagged;
            }
            (Mode::Tagged, Tok::PyEnd) => self.finish_tagged(true, out),
            // Markers and stray tags; inside a bare list a python tag is
            // dropped like a marker.
            _ => {}
        }
    }

    fn finish(&mut self, out: &mut Out, cut: bool) {
        match self.mode {
            Mode::Text => out.text(&take(&mut self.pending)),
            Mode::Reasoning => {}
            // Cut inside `[name(`: an unfinished call. A list that does not
            // look like calls yet (`[1, 2`, `[Note`) may be the answer.
            Mode::List if cut && opens_call(&self.body) => self.body.clear(),
            Mode::List => {
                let body = take(&mut self.body);
                out.malformed(&[&body]);
            }
            Mode::Tagged if cut => self.body.clear(),
            Mode::Tagged => self.finish_tagged(false, out),
        }
    }

    fn call_opens(&self) -> &[&'static str] {
        match self.mode {
            Mode::Text => &[PY_START],
            _ => &[],
        }
    }

    fn reset(&mut self) {
        self.mode = if self.starts_in_reasoning {
            Mode::Reasoning
        } else {
            Mode::Text
        };
        self.detect = true;
        self.pending.clear();
        self.body.clear();
        self.scan = Scan::default();
    }
}

/// Whether a list being collected already looks like calls: `[` then a
/// (dotted) name then `(`, whitespace allowed between.
fn opens_call(body: &str) -> bool {
    let mut p = Py { s: body };
    p.ws();
    if !p.eat("[") {
        return false;
    }
    p.ws();
    if p.dotted().is_none() {
        return false;
    }
    p.ws();
    p.eat("(")
}

/// `[name(k=v, ..), ..]` with Python literal values, as (name, JSON args).
/// `None` unless the whole text is such a list with at least one call.
pub(crate) fn parse_calls(s: &str) -> Option<Vec<(String, String)>> {
    let mut p = Py { s };
    if !p.eat("[") {
        return None;
    }
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.eat("]") {
            break;
        }
        let name = p.dotted()?;
        p.expect("(")?;
        let mut args = Map::new();
        loop {
            p.ws();
            if p.eat(")") {
                break;
            }
            let k = p.ident()?;
            p.expect("=")?;
            let v = p.value(0)?;
            args.insert(k.to_owned(), v);
            p.sep(')')?;
        }
        calls.push((name.to_owned(), Value::Object(args).to_string()));
        p.sep(']')?;
    }
    p.ws();
    (p.s.is_empty() && !calls.is_empty()).then_some(calls)
}

/// Deep enough for any real argument, shallow enough for the stack.
const MAX_DEPTH: usize = 64;

/// A cursor over Python source text.
struct Py<'a> {
    s: &'a str,
}

impl<'a> Cursor<'a> for Py<'a> {
    fn rest(&mut self) -> &mut &'a str {
        &mut self.s
    }
}

impl<'a> Py<'a> {
    fn ident(&mut self) -> Option<&'a str> {
        let end = self
            .s
            .char_indices()
            .find(|&(_, c)| !(c == '_' || c.is_alphanumeric()))
            .map_or(self.s.len(), |(i, _)| i);
        let id = &self.s[..end];
        if id.is_empty() || id.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        self.s = &self.s[end..];
        Some(id)
    }

    fn dotted(&mut self) -> Option<&'a str> {
        let start = self.s;
        self.ident()?;
        while self.s.starts_with('.') {
            self.s = &self.s[1..];
            self.ident()?;
        }
        Some(&start[..start.len() - self.s.len()])
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        let c = self.s.chars().next()?;
        match c {
            '\'' | '"' => {
                let mut out = self.string()?;
                // Adjacent literals concatenate.
                loop {
                    let save = self.s;
                    self.ws();
                    if self.s.starts_with(['\'', '"']) {
                        out.push_str(&self.string()?);
                    } else {
                        self.s = save;
                        break;
                    }
                }
                Some(Value::String(out))
            }
            '[' | '(' => {
                let close = if c == '[' { ']' } else { ')' };
                self.s = &self.s[1..];
                let mut a = Vec::new();
                loop {
                    self.ws();
                    if self.s.starts_with(close) {
                        self.s = &self.s[1..];
                        return Some(Value::Array(a));
                    }
                    a.push(self.value(depth + 1)?);
                    self.sep(close)?;
                }
            }
            '{' => {
                self.s = &self.s[1..];
                let mut m = Map::new();
                loop {
                    self.ws();
                    if self.eat("}") {
                        return Some(Value::Object(m));
                    }
                    let k = match self.value(depth + 1)? {
                        Value::String(k) => k,
                        v @ (Value::Number(_) | Value::Bool(_)) => v.to_string(),
                        _ => return None,
                    };
                    self.expect(":")?;
                    m.insert(k, self.value(depth + 1)?);
                    self.sep('}')?;
                }
            }
            _ => {
                for (word, v) in [
                    ("True", Value::Bool(true)),
                    ("False", Value::Bool(false)),
                    ("None", Value::Null),
                ] {
                    if let Some(r) = self.s.strip_prefix(word) {
                        if !r.starts_with(|c: char| c == '_' || c.is_alphanumeric()) {
                            self.s = r;
                            return Some(v);
                        }
                    }
                }
                self.number()
            }
        }
    }

    fn number(&mut self) -> Option<Value> {
        let b = self.s.as_bytes();
        let mut i = usize::from(b.first() == Some(&b'-') || b.first() == Some(&b'+'));
        while i < b.len() {
            let c = b[i];
            let exp_sign = (c == b'-' || c == b'+') && matches!(b[i - 1], b'e' | b'E');
            if !(c.is_ascii_digit() || c == b'.' || c == b'_' || c == b'e' || c == b'E' || exp_sign)
            {
                break;
            }
            i += 1;
        }
        let lit: String = self.s[..i].chars().filter(|&c| c != '_').collect();
        if !lit.bytes().any(|c| c.is_ascii_digit()) {
            return None;
        }
        let v = if lit.contains(['.', 'e', 'E']) {
            Value::Number(Number::from_f64(lit.parse::<f64>().ok()?)?)
        } else if let Ok(n) = lit.parse::<i64>() {
            Value::from(n)
        } else if let Ok(n) = lit.parse::<u64>() {
            Value::from(n)
        } else {
            Value::Number(Number::from_f64(lit.parse::<f64>().ok()?)?)
        };
        self.s = &self.s[i..];
        Some(v)
    }

    /// A quoted literal (single or triple quotes) with Python's escapes.
    fn string(&mut self) -> Option<String> {
        let q = self.s.chars().next()?;
        let triple: String = [q; 3].iter().collect();
        let close: &str = if self.s.starts_with(&triple) {
            self.s = &self.s[3..];
            &triple
        } else {
            self.s = &self.s[1..];
            &triple[..1]
        };
        let mut out = String::new();
        let mut it = self.s.char_indices();
        while let Some((i, c)) = it.next() {
            if c == '\\' {
                let (_, e) = it.next()?;
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    '\\' | '\'' | '"' => out.push(e),
                    '\n' => {}
                    'x' | 'u' | 'U' => {
                        let n = match e {
                            'x' => 2,
                            'u' => 4,
                            _ => 8,
                        };
                        let hex: String =
                            (0..n).filter_map(|_| it.next().map(|(_, h)| h)).collect();
                        let code = u32::from_str_radix(&hex, 16)
                            .ok()
                            .filter(|_| hex.len() == n)?;
                        out.push(char::from_u32(code)?);
                    }
                    other => {
                        out.push('\\');
                        out.push(other);
                    }
                }
            } else if self.s[i..].starts_with(close) {
                self.s = &self.s[i + close.len()..];
                return Some(out);
            } else if c == '\n' && close.len() == 1 {
                return None;
            } else {
                out.push(c);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_and_literals() {
        let c = parse_calls(r#"[get_weather(city="San Francisco", days=3), now()]"#).unwrap();
        assert_eq!(
            c,
            vec![
                (
                    "get_weather".into(),
                    r#"{"city":"San Francisco","days":3}"#.into()
                ),
                ("now".into(), "{}".into())
            ]
        );
        let c = parse_calls(
            "[m.f(a='it\\'s', b=[1, -2.5, (True, None)], c={'k': 'v', 1: False}, d='''x\"y''', e=1_000, f='a' \"b\", g=2e3,)]",
        )
        .unwrap();
        assert_eq!(c[0].0, "m.f");
        assert_eq!(
            c[0].1,
            json!({"a": "it's", "b": [1, -2.5, [true, null]], "c": {"k": "v", "1": false}, "d": "x\"y", "e": 1000, "f": "ab", "g": 2000.0}).to_string()
        );
        assert_eq!(
            parse_calls("[f(s='\\u00e9\\n')]").unwrap()[0].1,
            r#"{"s":"é\n"}"#
        );
        for bad in [
            "[]",
            "[1, 2]",
            "[f(1)]",
            "[f(a=x)]",
            "[f(a=1)] tail",
            "f(a=1)",
            "[f(a=1]",
            "[f(a='x\n')]",
            "[1f()]",
        ] {
            assert!(parse_calls(bad).is_none(), "{bad:?}");
        }
        let deep = format!("[f(a={}{})]", "[".repeat(100), "]".repeat(100));
        assert!(parse_calls(&deep).is_none());
    }
}
