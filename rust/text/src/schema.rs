//! What the request's tools declare about their parameters, for the
//! formats whose argument values are raw text (GLM-4.5, MiniMax M2).
//!
//! Such a value is a string when the tool's JSON Schema says its parameter
//! is a string; otherwise it is JSON when it parses as JSON, else a string
//! (as vLLM's `glm4_moe` and `minimax_m2` parsers do). Without schemas every
//! value that parses as JSON is JSON.
use std::collections::HashMap;

use serde_json::Value;

use crate::TextError;

/// Parameter types per tool, read from the tools' JSON Schemas.
///
/// ```
/// use cairn_text::ToolSchemas;
/// let s = ToolSchemas::from_json(
///     r#"{"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}"#,
/// ).unwrap();
/// assert!(s.is_string("get_weather", "city"));
/// assert!(!s.is_string("get_weather", "days"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolSchemas {
    /// tool name -> parameter name -> whether its type is string.
    strings: HashMap<String, HashMap<String, bool>>,
}

impl ToolSchemas {
    /// Reads `{"tool name": parameters schema, ...}`, or a list of tools:
    /// `{"name": .., "parameters" | "input_schema": {..}}`, also wrapped as
    /// `{"type": "function", "function": {..}}`.
    pub fn from_json(text: &str) -> Result<Self, TextError> {
        let bad = |m: &str| TextError::ToolSchemas(m.to_owned());
        let v: Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        let mut tools: Vec<(String, &Value)> = Vec::new();
        match &v {
            Value::Object(m) => tools.extend(m.iter().map(|(k, s)| (k.clone(), s))),
            Value::Array(a) => {
                for t in a {
                    let t = match t.get("function") {
                        Some(f @ Value::Object(_)) => f,
                        _ => t,
                    };
                    let name = t
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a tool has no name"))?;
                    let params = t.get("parameters").or_else(|| t.get("input_schema"));
                    tools.push((name.to_owned(), params.unwrap_or(&Value::Null)));
                }
            }
            _ => return Err(bad("expected an object of schemas or a list of tools")),
        }
        let mut strings = HashMap::new();
        for (name, schema) in tools {
            let mut params = HashMap::new();
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (p, s) in props {
                    params.insert(p.clone(), is_string_type(s));
                }
            }
            strings.insert(name, params);
        }
        Ok(ToolSchemas { strings })
    }

    /// Whether `tool` declares `param` a string.
    pub fn is_string(&self, tool: &str, param: &str) -> bool {
        self.strings
            .get(tool)
            .and_then(|p| p.get(param))
            .copied()
            .unwrap_or(false)
    }

    /// A raw-text argument value as JSON, by the rule above. String
    /// parameters keep their text exactly; others are trimmed first.
    pub(crate) fn value(&self, tool: &str, param: &str, raw: &str) -> Value {
        if self.is_string(tool, param) {
            return Value::String(raw.to_owned());
        }
        let t = raw.trim();
        serde_json::from_str(t).unwrap_or_else(|_| Value::String(t.to_owned()))
    }
}

/// `"type": "string"`, or a list of types that are string or null.
fn is_string_type(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => {
            ts.iter().any(|t| t == "string") && ts.iter().all(|t| t == "string" || t == "null")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_values() {
        let s = ToolSchemas::from_json(
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": ["string", "null"]}}}}},
                {"name": "g", "input_schema": {"properties": {"x": {"type": "string"}}}}]"#,
        )
        .unwrap();
        assert!(s.is_string("f", "a") && s.is_string("f", "c") && s.is_string("g", "x"));
        assert!(!s.is_string("f", "b") && !s.is_string("h", "a"));
        assert_eq!(s.value("f", "a", " 12 "), Value::String(" 12 ".into()));
        assert_eq!(s.value("f", "b", " 12 "), serde_json::json!(12));
        assert_eq!(s.value("f", "b", " x y "), Value::String("x y".into()));
        assert!(ToolSchemas::from_json("3").is_err());
        assert!(ToolSchemas::from_json("[{}]").is_err());
        assert!(ToolSchemas::from_json("{").is_err());
    }
}
