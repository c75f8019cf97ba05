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
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits::default();
        Ok(Self {
            factory: Arc::new(factory),
            eos: eos.to_vec(),
            width,
            trie_size,
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
        })
    }
}

/// One row's position in its grammar.
pub struct RowMatcher {
    m: Matcher,
    eos: Vec<u32>,
    width: usize,
    trie_size: usize,
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
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = if i < self.trie_size && vob.is_allowed(i as u32) {
                0.0
            } else {
                f32::NEG_INFINITY
            };
        }
        for &t in &self.eos {
            out[t as usize] = if eos_allowed { 0.0 } else { f32::NEG_INFINITY };
        }
        Ok(())
    }

    /// Whether the output so far is a complete match (an end of turn is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.m.is_accepting().unwrap_or(false)
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
    fn vocabulary_checks() {
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec()], &[], 4).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec()], &[3], 4).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec(); 5], &[0], 4).is_err());
    }
}
