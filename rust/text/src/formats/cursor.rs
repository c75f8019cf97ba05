//! The steps the hand-written argument parsers (Gemma 4's, pythonic's)
//! share: each keeps its place in the text as a `&str` and reads through it.

/// A parser's place in its text: the rest still to read.
pub(super) trait Cursor<'a> {
    /// The unread text.
    fn rest(&mut self) -> &mut &'a str;

    /// Skips whitespace.
    fn ws(&mut self) {
        let s = self.rest();
        *s = s.trim_start();
    }

    /// Reads `t` if the text starts with it.
    fn eat(&mut self, t: &str) -> bool {
        let s = self.rest();
        match s.strip_prefix(t) {
            Some(r) => {
                *s = r;
                true
            }
            None => false,
        }
    }

    /// Reads `t` after whitespace; `None` where the text goes on otherwise.
    fn expect(&mut self, t: &str) -> Option<()> {
        self.ws();
        self.eat(t).then_some(())
    }

    /// After an item: `,` or (left in place) the closing bracket.
    fn sep(&mut self, close: char) -> Option<()> {
        self.ws();
        (self.eat(",") || self.rest().starts_with(close)).then_some(())
    }
}
