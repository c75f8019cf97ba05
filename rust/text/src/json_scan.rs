//! Finds where a streamed JSON object or array ends, without parsing it.

/// Tracks bracket depth outside strings; `feed` reports when the top-level
/// value that started with `{` or `[` closes.
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

    /// Consumes bytes of `s`; returns how many were consumed and whether the
    /// value closed at the last of them. Stops right after the closing byte.
    pub fn feed(&mut self, s: &[u8]) -> (usize, bool) {
        for (i, &b) in s.iter().enumerate() {
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
                b'"' => self.in_str = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
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
