//! Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,..}<tool_call|>`.
//!
//! The argument syntax is not JSON: keys are bare, strings are delimited by
//! the `<|"|>` token (and hold any text but that token), other values are
//! bare words (numbers, `true`, `false`, `null`), objects `{..}` and arrays
//! `[..]`. Several calls may share one section.
use serde_json::{Map, Value};

use super::bodies::{name_ok, repeated, Calls};
use super::cursor::Cursor;
use crate::schema::ToolSchemas;

pub(crate) const QUOTE: &str = "<|\"|>";

/// `<tool_call|>` ends the section only outside a `<|"|>` string.
pub(crate) fn closes(body: &str) -> bool {
    body.matches(QUOTE).count() % 2 == 0
}

/// `call:NAME{..}`, once or more (whitespace between).
pub(crate) fn parse(body: &str, _: &ToolSchemas) -> Calls {
    repeated(body, |t| {
        let t = t.strip_prefix("call:")?;
        let brace = t.find('{')?;
        let name = t[..brace].trim();
        if !name_ok(name) {
            return None;
        }
        let mut p = P { s: &t[brace..] };
        let args = p.object()?;
        Some(((name.to_owned(), args.to_string()), p.s))
    })
}

/// A cursor over the argument text.
struct P<'a> {
    s: &'a str,
}

impl<'a> Cursor<'a> for P<'a> {
    fn rest(&mut self) -> &mut &'a str {
        &mut self.s
    }
}

impl P<'_> {
    fn string(&mut self) -> Option<String> {
        let (v, r) = self.s.split_once(QUOTE)?;
        self.s = r;
        Some(v.to_owned())
    }

    fn object(&mut self) -> Option<Value> {
        self.expect("{")?;
        let mut m = Map::new();
        loop {
            self.ws();
            if self.eat("}") {
                return Some(Value::Object(m));
            }
            let key = if self.eat(QUOTE) {
                self.string()?
            } else {
                let end = self.s.find(':')?;
                let k = self.s[..end].trim();
                if k.is_empty() || k.contains(['{', '}', '[', ']', ',', '<']) {
                    return None;
                }
                self.s = &self.s[end..];
                k.to_owned()
            };
            self.expect(":")?;
            let v = self.value()?;
            m.insert(key, v);
            self.sep('}')?;
        }
    }

    fn array(&mut self) -> Option<Value> {
        self.expect("[")?;
        let mut a = Vec::new();
        loop {
            self.ws();
            if self.eat("]") {
                return Some(Value::Array(a));
            }
            a.push(self.value()?);
            self.sep(']')?;
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.ws();
        if self.eat(QUOTE) {
            return self.string().map(Value::String);
        }
        match self.s.as_bytes().first()? {
            b'{' => self.object(),
            b'[' => self.array(),
            _ => {
                let end = self.s.find([',', '}', ']'])?;
                let bare = self.s[..end].trim();
                if bare.is_empty() || bare.contains('<') {
                    return None;
                }
                self.s = &self.s[end..];
                Some(match serde_json::from_str::<Value>(bare) {
                    Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Null)) => v,
                    _ => Value::String(bare.to_owned()),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(body: &str) -> Option<Vec<(String, String)>> {
        parse(body, &ToolSchemas::default())
    }

    #[test]
    fn values() {
        let c = p(r#"call:get_weather{location:<|"|>San Francisco, CA<|"|>,days:3,metric:true,x:null,f:-1.5}"#).unwrap();
        assert_eq!(c[0].0, "get_weather");
        assert_eq!(
            c[0].1,
            json!({"location": "San Francisco, CA", "days": 3, "metric": true, "x": null, "f": -1.5}).to_string()
        );
        let c = p(r#"call:f{o:{a:[<|"|>x<|"|>, 2, {b:<|"|>}]{,<|"|>}],<|"|>k y<|"|>:1}}call:g{}"#)
            .unwrap();
        assert_eq!(
            c[0].1,
            json!({"o": {"a": ["x", 2, {"b": "}]{,"}], "k y": 1}}).to_string()
        );
        assert_eq!(c[1], ("g".into(), "{}".into()));
        for bad in [
            "",
            "call:f",
            "call:{}",
            "f{}",
            "call:f{a:<|\"|>x}",
            "call:f{a:1",
            "call:f{a 1}",
            "call:f{} x",
        ] {
            assert!(p(bad).is_none(), "{bad:?}");
        }
        assert!(closes("call:f{a:<|\"|>x<|\"|>"));
        assert!(!closes("call:f{a:<|\"|>x"));
    }
}
