//! Streaming stop-sequence scanner over an Aho-Corasick DFA.
//!
//! The DFA state after the text seen so far is the longest suffix of that
//! text which is a prefix of some stop; its depth is exactly how much must be
//! held back. So one pass over each new byte gives both the earliest
//! completed match and the hold-back, with no rescanning of held text.
use std::collections::HashMap;

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::dfa::DFA;
use aho_corasick::{Anchored, MatchKind};

use crate::TextError;

/// Finds the earliest completed stop sequence in streamed text.
///
/// Ties (two stops completing at the same byte) go to the one listed first.
/// Text that could still grow into a stop is held back until it cannot, or
/// until [`StopScanner::flush`].
///
/// ```
/// use cairn_text::StopScanner;
/// let mut s = StopScanner::new(&["###"]).unwrap();
/// assert_eq!(s.push("Hello #"), ("Hello ".to_string(), None));
/// assert_eq!(s.push("#"), (String::new(), None));
/// assert_eq!(s.push("# world"), (String::new(), Some(0)));
/// ```
#[derive(Debug, Clone)]
pub struct StopScanner {
    stops: Vec<String>,
    dfa: Option<StopDfa>,
    state: StateID,
    held: String,
    matched: Option<usize>,
}

#[derive(Debug, Clone)]
struct StopDfa {
    dfa: DFA,
    start: StateID,
    /// Trie depth of every reachable state = bytes to hold back there.
    depth: HashMap<StateID, usize>,
}

impl StopScanner {
    /// Builds a scanner; an empty stop string is an error, an empty list
    /// passes everything through.
    pub fn new<S: AsRef<str>>(stops: &[S]) -> Result<Self, TextError> {
        let stops: Vec<String> = stops.iter().map(|s| s.as_ref().to_owned()).collect();
        if let Some(index) = stops.iter().position(|s| s.is_empty()) {
            return Err(TextError::EmptyStop { index });
        }
        let dfa = if stops.is_empty() {
            None
        } else {
            Some(StopDfa::build(&stops)?)
        };
        let state = dfa.as_ref().map_or(StateID::ZERO, |a| a.start);
        Ok(StopScanner {
            stops,
            dfa,
            state,
            held: String::new(),
            matched: None,
        })
    }

    /// The stop sequences, in priority order.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Index of the stop that matched, if one did.
    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Text currently held back as a possible stop prefix.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feeds `text`; returns the text now safe to show and the index of the
    /// stop that matched in this call, if any.
    pub fn push(&mut self, text: &str) -> (String, Option<usize>) {
        let mut out = String::new();
        let m = self.push_into(text, &mut out);
        (out, m)
    }

    /// Like [`StopScanner::push`], appending the visible text to `out`.
    pub fn push_into(&mut self, text: &str, out: &mut String) -> Option<usize> {
        if self.matched.is_some() {
            return None;
        }
        let Some(aut) = &self.dfa else {
            out.push_str(text);
            return None;
        };
        let dfa = &aut.dfa;
        let mut sid = self.state;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            sid = dfa.next_state(Anchored::No, sid, b);
            if dfa.is_special(sid) && dfa.is_match(sid) {
                // Standard semantics lists every stop ending here; the
                // lowest pattern id is the first in the caller's list.
                let best = (0..dfa.match_len(sid))
                    .map(|k| dfa.match_pattern(sid, k).as_usize())
                    .min()
                    .expect("a match state has a pattern");
                let end = self.held.len() + i + 1;
                let start = end - self.stops[best].len();
                if start <= self.held.len() {
                    out.push_str(&self.held[..start]);
                } else {
                    out.push_str(&self.held);
                    out.push_str(&text[..start - self.held.len()]);
                }
                self.held.clear();
                self.state = aut.start;
                self.matched = Some(best);
                return Some(best);
            }
        }
        self.state = sid;
        let keep = aut.depth[&sid];
        let held_len = self.held.len();
        let cut = held_len + text.len() - keep;
        if cut >= held_len {
            out.push_str(&self.held);
            out.push_str(&text[..cut - held_len]);
            self.held.clear();
            self.held.push_str(&text[cut - held_len..]);
        } else {
            out.push_str(&self.held[..cut]);
            self.held.drain(..cut);
            self.held.push_str(text);
        }
        None
    }

    /// Ends the stream: returns the held-back text (nothing after a match)
    /// and resets the scanner for a new stream.
    pub fn flush(&mut self) -> String {
        let mut out = String::new();
        self.flush_into(&mut out);
        out
    }

    /// Like [`StopScanner::flush`], appending to `out`.
    pub fn flush_into(&mut self, out: &mut String) {
        if self.matched.is_none() {
            out.push_str(&self.held);
        }
        self.reset();
    }

    /// Forgets all state: a fresh stream with the same stops.
    pub fn reset(&mut self) {
        self.held.clear();
        self.matched = None;
        if let Some(a) = &self.dfa {
            self.state = a.start;
        }
    }
}

impl StopDfa {
    fn build(stops: &[String]) -> Result<Self, TextError> {
        let dfa = DFA::builder()
            .match_kind(MatchKind::Standard)
            .build(stops)
            .map_err(|e| TextError::Build(e.to_string()))?;
        let start = dfa
            .start_state(Anchored::No)
            .map_err(|e| TextError::Build(e.to_string()))?;
        // Breadth-first from the start state: the first time a state is
        // reached is along its trie path, so that distance is its depth.
        // Bytes that occur in no stop always lead back to depth 0.
        let mut alphabet = [false; 256];
        for s in stops {
            for &b in s.as_bytes() {
                alphabet[b as usize] = true;
            }
        }
        let alphabet: Vec<u8> = (0..=255u8).filter(|&b| alphabet[b as usize]).collect();
        let mut depth = HashMap::new();
        depth.insert(start, 0usize);
        let mut frontier = vec![start];
        let mut d = 0;
        while !frontier.is_empty() {
            d += 1;
            let mut next = Vec::new();
            for &sid in &frontier {
                for &b in &alphabet {
                    let t = dfa.next_state(Anchored::No, sid, b);
                    if let std::collections::hash_map::Entry::Vacant(e) = depth.entry(t) {
                        e.insert(d);
                        next.push(t);
                    }
                }
            }
            frontier = next;
        }
        Ok(StopDfa { dfa, start, depth })
    }
}
