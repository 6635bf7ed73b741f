//! Stop strings over streamed text: text is released only once it cannot be the start of a stop
//! string, and generation ends before the first stop string (which is not returned, as OpenAI
//! does).

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, held: String::new() }
    }

    /// Add generated text. Returns the text safe to release and whether a stop string was hit
    /// (then the returned text is everything before it and nothing more may be pushed).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    /// The text held back at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, stop) = m.push(p);
            out += &t;
            if stop {
                return (out, true);
            }
        }
        out += &m.finish();
        (out, false)
    }

    #[test]
    fn stops_across_pieces_and_holds_back_partial_matches() {
        assert_eq!(run(&["\n\n"], &["a", "b\n", "\nc"]), ("ab".into(), true));
        assert_eq!(run(&["END"], &["xE", "N", "d"]), ("xENd".into(), false));
        assert_eq!(run(&["END", "x"], &["aEN", "Dx"]), ("a".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        let mut m = StopMatcher::new(vec!["éz".into()]);
        assert_eq!(m.push("aé"), ("a".into(), false));
        assert_eq!(m.push("b"), ("éb".into(), false));
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(run(&["c", "ab"], &["xabc"]), ("x".into(), true));
    }
}
