//! Naive reference implementations used by differential tests and fuzzers.

/// One-shot stop scan by brute force: for each end position in order, the
/// first stop (in list order) that ends there wins.
pub fn stop_scan(stops: &[&str], text: &str) -> (String, Option<usize>) {
    let b = text.as_bytes();
    for end in 1..=b.len() {
        for (i, s) in stops.iter().enumerate() {
            if !s.is_empty() && b[..end].ends_with(s.as_bytes()) {
                return (text[..end - s.len()].to_owned(), Some(i));
            }
        }
    }
    (text.to_owned(), None)
}

/// Length of the longest suffix of `text` that is a proper prefix of a stop.
pub fn stop_holdback(stops: &[&str], text: &str) -> usize {
    let b = text.as_bytes();
    let mut best = 0;
    for s in stops {
        let s = s.as_bytes();
        for k in (1..s.len()).rev() {
            if k <= b.len() && b.ends_with(&s[..k]) {
                best = best.max(k);
                break;
            }
        }
    }
    best
}
