//! Incremental detokenization with stop strings.
//!
//! Tokens arrive one at a time as raw bytes (byte-level BPE tokens can end in the middle of a
//! UTF-8 character). The detokenizer emits only complete characters, and holds back the longest
//! tail of the text that could still grow into a stop string, so a client never sees the start
//! of a stop string that is then retracted. When a stop string is found, the text before it is
//! emitted and the sequence is reported as stopped; the stop string itself is never emitted
//! (OpenAI semantics).

/// Text released by one call, and whether a stop string ended the sequence.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Detokenized {
    /// Newly released text (may be empty).
    pub text: String,
    /// A stop string matched; nothing more will be released.
    pub stopped: bool,
}

/// Per-sequence incremental detokenizer.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    /// Bytes of an incomplete UTF-8 character at the end of the stream.
    pending: Vec<u8>,
    /// Decoded text not yet released because it may be the start of a stop string.
    held: String,
    /// Stop strings (non-empty).
    stop: Vec<String>,
    /// Longest stop string in bytes.
    max_stop_len: usize,
    /// Set once a stop string matched.
    stopped: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer for one sequence; empty stop strings are ignored.
    pub fn new(stop: Vec<String>) -> Self {
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let max_stop_len = stop.iter().map(String::len).max().unwrap_or(0);
        Self {
            pending: Vec::new(),
            held: String::new(),
            stop,
            max_stop_len,
            stopped: false,
        }
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the bytes of one token and returns the text that can be released now.
    pub fn push(&mut self, bytes: &[u8]) -> Detokenized {
        let mut text = String::new();
        let stopped = self.push_into(bytes, &mut text);
        Detokenized { text, stopped }
    }

    /// Like [`IncrementalDetokenizer::push`], appending the released text to `out`; returns
    /// whether a stop string ended the sequence. Without stop strings and split characters
    /// (the common case) this allocates nothing.
    pub fn push_into(&mut self, bytes: &[u8], out: &mut String) -> bool {
        if self.stopped {
            return true;
        }
        if self.stop.is_empty() && self.pending.is_empty() {
            if let Ok(text) = std::str::from_utf8(bytes) {
                out.push_str(text);
                return false;
            }
        }
        self.pending.extend_from_slice(bytes);
        let decoded = self.take_complete_chars();
        let released = self.release(decoded);
        out.push_str(&released.text);
        released.stopped
    }

    /// Ends the stream: releases held text and renders a trailing incomplete character as U+FFFD.
    pub fn finish(&mut self) -> Detokenized {
        if self.stopped {
            return Detokenized {
                text: String::new(),
                stopped: true,
            };
        }
        let mut text = std::mem::take(&mut self.held);
        if !self.pending.is_empty() {
            text.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
        Detokenized {
            text,
            stopped: false,
        }
    }

    /// Decodes the longest prefix of `pending` made of complete characters; invalid bytes that
    /// can never become valid are replaced by U+FFFD.
    fn take_complete_chars(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Safe: the prefix up to `valid` is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    fn release(&mut self, decoded: String) -> Detokenized {
        if self.stop.is_empty() {
            return Detokenized {
                text: decoded,
                stopped: false,
            };
        }
        self.held.push_str(&decoded);
        // Earliest stop-string match in the held window; held text never contains a match that
        // started in already released text, because any possible start was held back.
        let hit = self
            .stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(pos) = hit {
            let text = self.held[..pos].to_string();
            self.held.clear();
            self.stopped = true;
            return Detokenized {
                text,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self.longest_stop_prefix_suffix();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Detokenized {
            text,
            stopped: false,
        }
    }

    /// Length in bytes of the longest suffix of `held` that is a prefix of a stop string,
    /// always on a character boundary.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let max = self.max_stop_len.saturating_sub(1).min(self.held.len());
        for len in (1..=max).rev() {
            let start = self.held.len() - len;
            if !self.held.is_char_boundary(start) {
                continue;
            }
            let suffix = &self.held[start..];
            if self.stop.iter().any(|s| s.starts_with(suffix)) {
                return len;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds byte chunks and returns the released pieces and whether it stopped.
    fn run(stop: &[&str], chunks: &[&[u8]]) -> (Vec<String>, bool) {
        let mut d = IncrementalDetokenizer::new(stop.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for c in chunks {
            let r = d.push(c);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push(d.finish().text);
        (out, false)
    }

    #[test]
    fn never_splits_a_utf8_character() {
        let euro = "€".as_bytes(); // 3 bytes
        let (out, stopped) = run(&[], &[b"a", &euro[..1], &euro[1..2], &euro[2..], b"b"]);
        assert_eq!(out, vec!["a", "", "", "€", "b", ""]);
        assert!(!stopped);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let (out, _) = run(&[], &[b"x\xffy"]);
        assert_eq!(out.concat(), "x\u{FFFD}y");
        let (out, _) = run(&[], &[b"z\xe2\x82"]);
        assert_eq!(out.concat(), "z\u{FFFD}");
    }

    #[test]
    fn stop_string_spanning_tokens_is_not_emitted() {
        let (out, stopped) = run(&["END"], &[b"hello E", b"N", b"D more"]);
        assert!(stopped);
        assert_eq!(out, vec!["hello ", "", ""]);
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let (out, stopped) = run(&["END"], &[b"a E", b"x"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a ", "Ex", ""]);
    }

    #[test]
    fn held_text_is_flushed_at_finish() {
        let (out, stopped) = run(&["\n\n"], &[b"line\n"]);
        assert!(!stopped);
        assert_eq!(out, vec!["line", "\n"]);
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let (out, stopped) = run(&["world", "lo w"], &[b"hello world"]);
        assert!(stopped);
        assert_eq!(out, vec!["hel"]);
    }

    #[test]
    fn stop_string_inside_a_multibyte_tail_keeps_boundaries() {
        let (out, stopped) = run(&["éx"], &["aé".as_bytes(), b"y"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "aéy");
    }
}
