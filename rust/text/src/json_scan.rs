//! Follows a streamed JSON body (bracket depth and string state) without
//! parsing it, so the parser knows when it is inside a string.

/// Tracks bracket depth and whether the scan is inside a JSON string.
///
/// A `"` opens a string only inside brackets: a body that is not JSON (a
/// Python-style `f(q="x")` after Llama's `<|python_tag|>`, or the name in
/// Mistral's `name[ARGS]{..}`) has no strings, so a stray quote there cannot
/// swallow the closing tag. Backslash escapes are honoured across calls.
///
/// ```text
/// {"a": "x</tool_call>\"y"}   in_str over  x</tool_call>\"y
///  ^depth 1                   closed at the last `}`
/// ```
#[derive(Debug, Clone, Default)]
pub(crate) struct JsonScan {
    depth: u32,
    in_str: bool,
    esc: bool,
}

impl JsonScan {
    pub fn reset(&mut self) {
        *self = JsonScan::default();
    }

    /// Whether the bytes fed so far end inside a string.
    pub fn in_str(&self) -> bool {
        self.in_str
    }

    /// Consumes bytes of `s` until `stop(byte, in_str)` holds for the next
    /// byte (left unconsumed) or a top-level value closes (its closing byte
    /// consumed). Returns how many bytes were consumed and whether it closed.
    pub fn feed_until(&mut self, s: &[u8], stop: impl Fn(u8, bool) -> bool) -> (usize, bool) {
        for (i, &b) in s.iter().enumerate() {
            if stop(b, self.in_str) {
                return (i, false);
            }
            if self.in_str {
                if self.esc {
                    self.esc = false;
                } else if b == b'\\' {
                    self.esc = true;
                } else if b == b'"' {
                    self.in_str = false;
                }
                continue;
            }
            match b {
                b'"' if self.depth > 0 => self.in_str = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
        }
        (s.len(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(chunks: &[&str]) -> (bool, bool) {
        let mut j = JsonScan::default();
        let mut closed = false;
        for c in chunks {
            let mut b = c.as_bytes();
            while !b.is_empty() {
                let (n, done) = j.feed_until(b, |_, _| false);
                closed |= done;
                b = &b[n..];
            }
        }
        (j.in_str(), closed)
    }

    #[test]
    fn strings_escapes_and_depth() {
        assert_eq!(states(&[r#"{"a": "}"#]), (true, false));
        assert_eq!(states(&[r#"{"a": "\"}"#]), (true, false));
        assert_eq!(states(&[r#"{"a": "\"#, r#""}"#]), (true, false));
        assert_eq!(states(&[r#"{"a": "\\"#, r#""}"#]), (false, true));
        assert_eq!(states(&[r#"{"a": ["x]"]}"#]), (false, true));
        // Quotes outside brackets are not strings.
        assert_eq!(states(&[r#"f(q=""#]), (false, false));
        assert_eq!(states(&[r#"} "x"#]), (false, false));
    }

    #[test]
    fn stops_before_the_chosen_byte() {
        let mut j = JsonScan::default();
        let stop = |b: u8, in_str: bool| b == b'<' || (!in_str && b == b'[');
        assert_eq!(j.feed_until(br#"{"[x"#, stop), (4, false));
        assert_eq!(j.feed_until(br#"<y"#, stop), (0, false));
        assert_eq!(j.feed_until(br#"", [1"#, stop), (3, false));
    }
}
