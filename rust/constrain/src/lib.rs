//! Grammar-constrained decoding on llguidance: one vocabulary per tokenizer,
//! one compiled grammar per request, one matcher per generating row.
//!
//! ```
//! use cairn_constrain::{Grammar, Vocabulary};
//! // A toy vocabulary: token i is the single byte b'a' + i; token 26 ends the turn.
//! let words: Vec<Vec<u8>> = (0..26u8).map(|i| vec![b'a' + i]).chain([vec![0xff]]).collect();
//! let vocab = Vocabulary::from_token_bytes(words, &[26], 27).unwrap();
//! let grammar = vocab.compile(&Grammar::Lark(r#"start: "abc""#.into())).unwrap();
//! let mut row = vocab.matcher(&grammar).unwrap();
//! let mut mask = vec![0f32; 27];
//! row.fill_mask(&mut mask).unwrap();
//! assert_eq!(mask[0], 0.0);                 // 'a' may come first
//! assert_eq!(mask[1], f32::NEG_INFINITY);   // 'b' may not
//! for t in [0, 1, 2] { row.consume(t).unwrap(); }
//! row.fill_mask(&mut mask).unwrap();
//! assert_eq!(mask[26], 0.0);                // done: only the end of the turn
//! assert!(row.is_accepting());
//! ```
//!
//! A mask is additive: 0.0 for an allowed token, -inf for the others, one
//! entry per logit (the model's logits may be wider than the tokenizer's
//! vocabulary; the extra ids are never allowed). Every end-of-turn id is
//! allowed exactly when the grammar accepts, and once the grammar has ended
//! nothing else is.

use std::fmt;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};

/// Bytes a completion tries first, in order: closers, separators, the start of
/// a closing tag, then the characters formats and patterns are made of.
const PREFERRED: &[u8] = b"\"}])>,:<0-.@_/aA";

/// Bytes that close something (an object, an array, a string, a call).
const CLOSERS: &[u8] = b"\"}])>";

/// Why a vocabulary, a grammar or a step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConstrainError {
    /// The tokenizer description could not be read.
    Vocabulary(String),
    /// The grammar or JSON schema does not compile (the message names the part).
    Grammar(String),
    /// A token the grammar does not allow was fed, or the matcher failed.
    Step(String),
}

impl fmt::Display for ConstrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Vocabulary(m) => write!(f, "tokenizer: {m}"),
            Self::Grammar(m) => write!(f, "{m}"),
            Self::Step(m) => write!(f, "constrained decoding: {m}"),
        }
    }
}

impl std::error::Error for ConstrainError {}

/// A grammar as a request gives it.
#[derive(Debug, Clone)]
pub enum Grammar {
    /// A JSON Schema (as JSON text); the output is one JSON value it accepts.
    JsonSchema(String),
    /// llguidance's Lark-like syntax (may embed schemas with `%json { ... }`).
    Lark(String),
}

/// A compiled grammar: clone-cheap, one per request; each row gets a [`RowMatcher`].
#[derive(Clone)]
pub struct Compiled {
    parser: TokenParser,
}

/// A tokenizer's token trie and the factory that compiles grammars over it.
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    eos: Vec<u32>,
    width: usize,
    trie_size: usize,
    steps: Arc<Steps>,
}

/// The tokens a completion is written in: one per byte, and the special tokens.
struct Steps {
    env: TokEnv,
    /// The token of each single byte (byte-level vocabularies have all 256).
    byte: [Option<u32>; 256],
    special: Vec<u32>,
}

impl Vocabulary {
    /// From a Hugging Face `tokenizer.json` (special tokens cannot be produced
    /// by grammar text; `eos` ids end a turn; `width` is the logits width).
    pub fn from_tokenizer_json(
        json: &str,
        eos: &[u32],
        width: usize,
    ) -> Result<Self, ConstrainError> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        let words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        Self::from_token_bytes(words, eos, width)
    }

    /// From each token's bytes (special tokens start with 0xFF, as llguidance marks them).
    pub fn from_token_bytes(
        words: Vec<Vec<u8>>,
        eos: &[u32],
        width: usize,
    ) -> Result<Self, ConstrainError> {
        let first = *eos
            .first()
            .ok_or_else(|| ConstrainError::Vocabulary("no end-of-turn token".into()))?;
        if words.is_empty() || words.len() > width {
            return Err(ConstrainError::Vocabulary(format!(
                "{} tokens do not fit {} logits",
                words.len(),
                width
            )));
        }
        if eos.iter().any(|&t| t as usize >= words.len()) {
            return Err(ConstrainError::Vocabulary(
                "an end-of-turn id is outside the vocabulary".into(),
            ));
        }
        let trie_size = words.len();
        let info = TokRxInfo::new(trie_size as u32, first);
        let trie = TokTrie::from(&info, &words);
        let mut byte = [None; 256];
        for (b, slot) in byte.iter_mut().enumerate() {
            *slot = trie.token_id(&[b as u8]);
        }
        let special = (0..trie_size as u32)
            .filter(|&t| trie.is_special_token(t) && !eos.contains(&t))
            .collect();
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let steps = Arc::new(Steps {
            env: env.clone(),
            byte,
            special,
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits::default();
        Ok(Self {
            factory: Arc::new(factory),
            eos: eos.to_vec(),
            width,
            trie_size,
            steps,
        })
    }

    /// Number of logits a mask covers.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Compile `grammar` (an error names what does not compile).
    pub fn compile(&self, grammar: &Grammar) -> Result<Compiled, ConstrainError> {
        let top = match grammar {
            Grammar::JsonSchema(text) => {
                let value: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| ConstrainError::Grammar(format!("the schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(value)
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        // A schema is request input: a panic inside the grammar compiler is a
        // refusal of that schema, never a crash of the server.
        let factory = &self.factory;
        let parser =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory.create_parser(top)))
                .map_err(|_| {
                    ConstrainError::Grammar("the grammar compiler failed on this schema".into())
                })?
                .map_err(|e| ConstrainError::Grammar(e.to_string()))?;
        Ok(Compiled { parser })
    }

    /// A fresh matcher for one row.
    pub fn matcher(&self, grammar: &Compiled) -> Result<RowMatcher, ConstrainError> {
        let m = Matcher::new(Ok(grammar.parser.deep_clone()));
        if let Some(e) = m.get_error() {
            return Err(ConstrainError::Grammar(e));
        }
        Ok(RowMatcher {
            m,
            eos: self.eos.clone(),
            width: self.width,
            trie_size: self.trie_size,
            steps: self.steps.clone(),
        })
    }
}

/// One row's position in its grammar.
pub struct RowMatcher {
    m: Matcher,
    eos: Vec<u32>,
    width: usize,
    trie_size: usize,
    steps: Arc<Steps>,
}

impl RowMatcher {
    /// Advance by one sampled token. An end-of-turn token ends the grammar.
    pub fn consume(&mut self, token: u32) -> Result<(), ConstrainError> {
        if self.eos.contains(&token) {
            // Every end-of-turn id is the trie's one EOS to the matcher.
            let eos = self.eos[0];
            return self
                .m
                .consume_token(eos)
                .map_err(|e| ConstrainError::Step(e.to_string()));
        }
        if token as usize >= self.trie_size {
            return Err(ConstrainError::Step(format!(
                "token {token} is outside the vocabulary"
            )));
        }
        self.m
            .consume_token(token)
            .map_err(|e| ConstrainError::Step(e.to_string()))
    }

    /// Write the additive mask of the next token into `out` (length = width).
    pub fn fill_mask(&mut self, out: &mut [f32]) -> Result<(), ConstrainError> {
        if out.len() != self.width {
            return Err(ConstrainError::Step(format!(
                "mask buffer of {} for {} logits",
                out.len(),
                self.width
            )));
        }
        let vob = self
            .m
            .compute_mask_or_eos()
            .map_err(|e| ConstrainError::Step(e.to_string()))?;
        let eos_allowed = vob.is_allowed(self.eos[0]);
        // 32 entries per word of the bitmask, branch-free: this loop and the
        // mask itself are the whole per-step cost.
        let (inside, outside) = out.split_at_mut(self.trie_size);
        for (chunk, &word) in inside.chunks_mut(32).zip(vob.as_slice()) {
            for (j, slot) in chunk.iter_mut().enumerate() {
                *slot = if (word >> j) & 1 != 0 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        let covered = (vob.as_slice().len() * 32).min(inside.len());
        inside[covered..].fill(f32::NEG_INFINITY);
        outside.fill(f32::NEG_INFINITY);
        for &t in &self.eos {
            out[t as usize] = if eos_allowed { 0.0 } else { f32::NEG_INFINITY };
        }
        Ok(())
    }

    /// A short way to finish the grammar from here, as tokens to feed in order
    /// (single-byte tokens and special tokens), at most `max_len` of them; None
    /// when none is found within that length and `effort` grammar checks.
    ///
    /// A depth-first search on a copy of the matcher. At each point it tries the
    /// bytes that close or separate things first ([`PREFERRED`]); a byte after
    /// which the same of those are allowed as before (a character inside a free
    /// string) makes no progress, so it is followed only when nothing else is
    /// left, without branching (a `minLength` or a counted pattern needs it).
    pub fn completion(&self, max_len: usize, effort: usize) -> Option<Vec<u32>> {
        let mut m = self.m.deep_clone();
        if m.is_error() {
            return None;
        }
        let mut path = Vec::new();
        let mut left = effort;
        if self.search(&mut m, None, &mut path, &mut Vec::new(), max_len, &mut left) {
            Some(path)
        } else {
            None
        }
    }

    fn search(
        &self,
        m: &mut Matcher,
        known: Option<u64>,
        path: &mut Vec<u32>,
        seen: &mut Vec<u64>,
        max_len: usize,
        left: &mut usize,
    ) -> bool {
        if m.is_accepting().unwrap_or(false) {
            return true;
        }
        if path.len() >= max_len || *left == 0 || m.is_error() {
            return false;
        }
        let sig = known.unwrap_or_else(|| self.signature(m, left));
        seen.push(sig);
        let found = self.expand(m, sig, path, seen, max_len, left);
        seen.pop();
        found
    }

    fn expand(
        &self,
        m: &mut Matcher,
        sig: u64,
        path: &mut Vec<u32>,
        seen: &mut Vec<u64>,
        max_len: usize,
        left: &mut usize,
    ) -> bool {
        let mut stay = None;
        for (i, &b) in PREFERRED.iter().enumerate() {
            if sig & (1 << i) == 0 {
                continue;
            }
            let Some(t) = self.steps.byte[b as usize] else {
                continue;
            };
            if let Some(found) = self.step(m, t, path, seen, max_len, left, &mut stay) {
                return found;
            }
        }
        // Special tokens (a family's markers), then the other allowed bytes:
        // printable ones first, whitespace last (a layout gap is never needed
        // before a value is).
        let Ok(mask) = m.compute_mask() else {
            return false;
        };
        *left = left.saturating_sub(32);
        let others = (0x21u8..0x7f)
            .chain(0x80..=0xff)
            .chain([b' ', b'\n', b'\t', b'\r'])
            .filter(|b| !PREFERRED.contains(b))
            .filter_map(|b| self.steps.byte[b as usize]);
        let candidates: Vec<u32> = self
            .steps
            .special
            .iter()
            .copied()
            .chain(others)
            .filter(|&t| mask.is_allowed(t))
            .collect();
        for (tried, &t) in candidates.iter().enumerate() {
            // A few distinct bytes tell whether this point moves on by itself;
            // past that the characters are a free text's, and `stay` takes one.
            if tried >= 4 && !self.steps.special.contains(&t) {
                break;
            }
            if let Some(found) = self.step(m, t, path, seen, max_len, left, &mut stay) {
                return found;
            }
        }
        if stay.is_none() {
            stay = candidates.first().copied();
        }
        let Some(t) = stay else { return false };
        if m.try_consume_tokens(&[t]).unwrap_or(0) != 1 {
            return false;
        }
        path.push(t);
        if self.search(m, None, path, seen, max_len, left) {
            return true;
        }
        path.pop();
        let _ = m.rollback(1);
        false
    }

    /// Try `t` from the point whose signature is last in `seen`: Some(true) when a
    /// completion was found through it, Some(false) when the search must stop,
    /// None to go on (`t` made no progress, and is kept in `stay` as the
    /// fallback, or led nowhere). A signature already met on the way here is no
    /// progress either (`}.}.` inside an e-mail address goes round in a loop).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        m: &mut Matcher,
        t: u32,
        path: &mut Vec<u32>,
        seen: &mut Vec<u64>,
        max_len: usize,
        left: &mut usize,
        stay: &mut Option<u32>,
    ) -> Option<bool> {
        if *left == 0 {
            return Some(false);
        }
        *left -= 1;
        if m.try_consume_tokens(&[t]).unwrap_or(0) != 1 {
            return None;
        }
        let child = self.signature(m, left);
        // Closing a nested object leaves the same bytes allowed as before it: a
        // closer that does so is progress, for as deep as nesting plausibly goes
        // (in free text the same byte would just repeat).
        let run = seen.iter().rev().take_while(|&&s| s == child).count();
        let closes =
            CLOSERS.contains(&self.steps.env.tok_trie().token(t)[0]) && (1..32).contains(&run);
        if !closes && seen.iter().rev().take(16).any(|&s| s == child) {
            stay.get_or_insert(t);
            return m.rollback(1).is_err().then_some(false);
        }
        path.push(t);
        if self.search(m, Some(child), path, seen, max_len, left) {
            return Some(true);
        }
        path.pop();
        m.rollback(1).is_err().then_some(false)
    }

    /// Which [`PREFERRED`] bytes may come next (one bit each) and whether the
    /// grammar accepts here (the top bit).
    fn signature(&self, m: &mut Matcher, left: &mut usize) -> u64 {
        let mut sig = u64::from(m.is_accepting().unwrap_or(false)) << 63;
        for (i, &b) in PREFERRED.iter().enumerate() {
            if let Some(t) = self.steps.byte[b as usize] {
                if m.validate_tokens(&[t]).unwrap_or(0) == 1 {
                    sig |= 1 << i;
                }
            }
        }
        *left = left.saturating_sub(PREFERRED.len());
        sig
    }

    /// `plan` (as [`Self::completion`] gives it) written in exactly `n` tokens where
    /// it can be: runs of bytes merge into the vocabulary's longer tokens until the
    /// count is `n`. A plan of fewer than `n` tokens comes back as it is; one that
    /// cannot shrink to `n` comes back as short as greedy merging makes it.
    pub fn fit(&self, plan: &[u32], n: usize) -> Vec<u32> {
        let trie = self.steps.env.tok_trie();
        let mut excess = plan.len().saturating_sub(n);
        let mut out = Vec::with_capacity(plan.len());
        let mut i = 0;
        while i < plan.len() {
            let run_end = plan[i..]
                .iter()
                .position(|&t| trie.token_len(t) != 1 || trie.is_special_token(t))
                .map_or(plan.len(), |p| i + p);
            if run_end == i {
                out.push(plan[i]);
                i += 1;
                continue;
            }
            let bytes: Vec<u8> = plan[i..run_end].iter().map(|&t| trie.token(t)[0]).collect();
            let mut j = 0;
            while j < bytes.len() {
                // The longest token from here that does not merge past the target.
                let (mut best, mut best_len) = (plan[i + j], 1);
                let mut node = trie.root();
                for (d, &b) in bytes[j..].iter().enumerate().take(excess + 1) {
                    let Some(next) = trie.child_at_byte(node, b) else {
                        break;
                    };
                    node = next;
                    if let Some(t) = node.token_id() {
                        if !trie.is_special_token(t) {
                            (best, best_len) = (t, d + 1);
                        }
                    }
                }
                out.push(best);
                excess -= best_len - 1;
                j += best_len;
            }
            i = run_end;
        }
        out
    }

    /// Whether the output so far is a complete match (an end of turn is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.m.is_accepting().unwrap_or(false)
    }

    /// The end-of-turn ids (all of them end the grammar).
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Whether the grammar has ended (only an end of turn may follow).
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes 0x20..0x7f as single-byte tokens, a few multi-byte ones, and an EOS.
    fn vocab() -> Vocabulary {
        let mut words: Vec<Vec<u8>> = (0x20u8..0x7f).map(|b| vec![b]).collect();
        for w in ["{\"", "\":", "true", "false", "null", "  "] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(vec![0xff, b'E']);
        let eos = (words.len() - 1) as u32;
        Vocabulary::from_token_bytes(words, &[eos], 128).unwrap()
    }

    fn id(v: &[u8]) -> u32 {
        u32::from(v[0]) - 0x20
    }

    fn allowed(mask: &[f32]) -> Vec<usize> {
        mask.iter()
            .enumerate()
            .filter(|(_, &m)| m == 0.0)
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn json_schema_walks_to_the_end() {
        let v = vocab();
        let g = v
            .compile(&Grammar::JsonSchema(
                r#"{"type":"object","properties":{"a":{"type":"boolean"}},"required":["a"],"additionalProperties":false}"#
                    .into(),
            ))
            .unwrap();
        let mut row = v.matcher(&g).unwrap();
        let mut mask = vec![0f32; 128];
        let text = br#"{"a":true}"#;
        for &b in text {
            row.fill_mask(&mut mask).unwrap();
            assert_eq!(mask[id(&[b]) as usize], 0.0, "byte {:?} refused", b as char);
            row.consume(id(&[b])).unwrap();
        }
        row.fill_mask(&mut mask).unwrap();
        let eos = 101;
        assert!(row.is_accepting());
        assert_eq!(allowed(&mask), vec![eos]);
        // Logits past the vocabulary are never allowed.
        assert!(mask[102..].iter().all(|m| *m == f32::NEG_INFINITY));
    }

    #[test]
    fn a_wrong_token_is_an_error_and_eos_waits_for_acceptance() {
        let v = vocab();
        let g = v.compile(&Grammar::Lark(r#"start: "ab""#.into())).unwrap();
        let mut row = v.matcher(&g).unwrap();
        let mut mask = vec![0f32; 128];
        row.fill_mask(&mut mask).unwrap();
        assert_eq!(mask[101], f32::NEG_INFINITY);
        assert!(row.consume(id(b"z")).is_err());
    }

    #[test]
    fn bad_schemas_name_the_problem() {
        let v = vocab();
        let e = v
            .compile(&Grammar::JsonSchema("{not json".into()))
            .err()
            .unwrap();
        assert!(e.to_string().contains("not JSON"), "{e}");
        let e = v
            .compile(&Grammar::JsonSchema(
                r##"{"type":"object","$ref":"#/$defs/missing"}"##.into(),
            ))
            .err()
            .unwrap();
        assert!(e.to_string().contains("missing"), "{e}");
        assert!(v
            .compile(&Grammar::Lark("start: undefined_rule".into()))
            .is_err());
    }

    #[test]
    fn a_way_to_finish_is_found_and_fitted_to_a_count() {
        let v = vocab();
        let g = v
            .compile(&Grammar::JsonSchema(
                r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"type":"array","items":{"type":"boolean"},"minItems":1}},"required":["a","b"],"additionalProperties":false}"#
                    .into(),
            ))
            .unwrap();
        let mut row = v.matcher(&g).unwrap();
        for &b in br#"{"a":"looping"# {
            row.consume(id(&[b])).unwrap();
        }
        let way = row.completion(64, 4000).unwrap();
        let text: Vec<u8> = way.iter().map(|&t| (t + 0x20) as u8).collect();
        assert_eq!(
            text,
            br#"","b":[false]}"#.to_vec(),
            "{}",
            String::from_utf8_lossy(&text)
        );
        // The matcher itself did not move.
        let mut mask = vec![0f32; 128];
        row.fill_mask(&mut mask).unwrap();
        assert_eq!(mask[id(b"x") as usize], 0.0);
        // Fitted: as written, merged where the vocabulary has longer tokens, never longer.
        assert_eq!(row.fit(&way, way.len()), way);
        let short = row.fit(&way, 1);
        assert!(short.len() < way.len());
        assert_eq!(row.fit(&way, way.len() - 1).len(), way.len() - 1);
        for t in short {
            row.consume(t).unwrap();
        }
        assert!(row.is_accepting());
    }

    #[test]
    fn vocabulary_checks() {
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec()], &[], 4).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec()], &[3], 4).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec(); 5], &[0], 4).is_err());
    }
}
