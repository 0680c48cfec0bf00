//! Turning generated tokens into the text a client sees: token bytes are assembled into UTF-8
//! (a character may span tokens), and stop strings are matched across token boundaries. Text
//! that could still turn out to be the start of a stop string is held back until it is decided,
//! so a matched stop string, and anything after it, is never sent.

/// The text side of one request's output.
#[derive(Debug, Clone, Default)]
pub struct TextFilter {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text not yet released.
    held: String,
    /// A stop string was found; nothing more is released.
    stopped: bool,
}

/// What [`TextFilter::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can be sent now.
    pub text: String,
    /// A stop string was completed; generation ends.
    pub stop: bool,
}

impl TextFilter {
    /// A filter for these stop strings (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        TextFilter {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..TextFilter::default()
        }
    }

    /// Adds the bytes of the next token.
    pub fn push(&mut self, bytes: &[u8]) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stop: true,
            };
        }
        self.pending.extend_from_slice(bytes);
        self.decode_pending(false);
        if let Some(at) = self.earliest_stop() {
            self.stopped = true;
            self.held.truncate(at);
            return Released {
                text: std::mem::take(&mut self.held),
                stop: true,
            };
        }
        let keep = self.longest_partial_stop();
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Released { text, stop: false }
    }

    /// Ends the output: what is still held is released (an incomplete character as U+FFFD),
    /// unless a stop string ended it.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.decode_pending(true);
        std::mem::take(&mut self.held)
    }

    /// Moves complete characters from `pending` to `held`; bytes that can never form one become
    /// U+FFFD, and with `flush` so does an incomplete tail.
    fn decode_pending(&mut self, flush: bool) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    self.held.push_str(text);
                    self.pending.clear();
                    return;
                }
                Err(error) => {
                    let valid = error.valid_up_to();
                    // The first `valid` bytes were just checked to be UTF-8.
                    self.held
                        .push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or(""));
                    match error.error_len() {
                        Some(bad) => {
                            self.held.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                        None if flush => {
                            self.held.push(char::REPLACEMENT_CHARACTER);
                            self.pending.clear();
                            return;
                        }
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Byte offset in `held` of the earliest complete stop string.
    fn earliest_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
    }

    /// Bytes at the end of `held` that are a proper prefix of some stop string (so they must wait),
    /// cut at a character boundary.
    fn longest_partial_stop(&self) -> usize {
        let mut keep = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.held.len());
            for len in (keep + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&self.held.as_bytes()[start..])
                {
                    keep = len;
                    break;
                }
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns (all released text, whether a stop was hit, the piece index at
    /// which it was hit).
    fn run(stops: &[&str], pieces: &[&[u8]]) -> (String, Option<usize>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut filter = TextFilter::new(&stops);
        let mut out = String::new();
        for (i, piece) in pieces.iter().enumerate() {
            let released = filter.push(piece);
            out.push_str(&released.text);
            if released.stop {
                return (out, Some(i));
            }
        }
        out.push_str(&filter.finish());
        (out, None)
    }

    #[test]
    fn text_without_stops_passes_through() {
        assert_eq!(
            run(&[], &[b"Hello", b", ", b"world"]),
            ("Hello, world".into(), None)
        );
    }

    #[test]
    fn a_stop_string_across_tokens_is_cut_with_what_follows() {
        assert_eq!(
            run(&["END"], &[b"abc E", b"N", b"D and more"]),
            ("abc ".into(), Some(2))
        );
        // The earliest of several stops wins.
        assert_eq!(
            run(&["world", "lo"], &[b"Hello world"]),
            ("Hel".into(), Some(0))
        );
    }

    #[test]
    fn a_partial_match_that_fails_is_released_later() {
        let stops = vec!["END".to_string()];
        let mut filter = TextFilter::new(&stops);
        assert_eq!(filter.push(b"x E").text, "x ");
        assert_eq!(filter.push(b"N").text, "");
        let released = filter.push(b"X");
        assert_eq!(released.text, "ENX");
        assert!(!released.stop);
        assert_eq!(filter.finish(), "");
    }

    #[test]
    fn held_text_is_released_at_the_end() {
        assert_eq!(run(&["STOP"], &[b"ab", b"ST"]), ("abST".into(), None));
    }

    #[test]
    fn utf8_split_across_tokens_waits_for_the_rest() {
        let euro = "\u{20ac}".as_bytes();
        let stops: Vec<String> = Vec::new();
        let mut filter = TextFilter::new(&stops);
        assert_eq!(filter.push(&euro[..1]).text, "");
        assert_eq!(filter.push(&euro[1..]).text, "\u{20ac}");
        // An incomplete character at the end becomes U+FFFD; an invalid byte too.
        assert_eq!(filter.push(&euro[..2]).text, "");
        assert_eq!(filter.finish(), "\u{fffd}");
        assert_eq!(run(&[], &[b"a\xffb"]), ("a\u{fffd}b".into(), None));
    }

    #[test]
    fn stops_match_multibyte_text_at_character_boundaries() {
        assert_eq!(
            run(
                &["\u{e9}t\u{e9}"],
                &["caf\u{e9} \u{e9}".as_bytes(), "t\u{e9}!".as_bytes()]
            ),
            ("caf\u{e9} ".into(), Some(1))
        );
    }
}
