//! Incremental detokenization with stop strings.
//!
//! Tokens arrive one at a time as raw bytes (byte-level BPE tokens can end in the middle of a
//! UTF-8 character). The detokenizer emits only complete characters, and holds back the longest
//! tail of the text that could still grow into a stop string, so a client never sees the start
//! of a stop string that is then retracted. When a stop string is found, the text before it is
//! emitted and the sequence is reported as stopped; the stop string itself is not emitted
//! (OpenAI semantics) unless the request asks for it (vLLM's `include_stop_str_in_output`).
//! Until a sequence has its `min_tokens`, stop strings are not looked for (vLLM), though text
//! that may start one is still held back.

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
    /// A matched stop string is released with the text before it.
    include_stop: bool,
    /// Stop strings end the sequence (false while it is short of its `min_tokens`).
    armed: bool,
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
            include_stop: false,
            armed: true,
        }
    }

    /// Releases a matched stop string with the text before it (vLLM's
    /// `include_stop_str_in_output`).
    pub fn include_stop(mut self, include: bool) -> Self {
        self.include_stop = include;
        self
    }

    /// Whether a stop string found from now on ends the sequence; a disarmed detokenizer
    /// releases a whole stop string as text (a sequence short of its `min_tokens`).
    pub fn arm(&mut self, armed: bool) {
        self.armed = armed;
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

    /// Ends the stream: releases held text. A trailing incomplete character (generation
    /// stopped inside a multi-byte character) is dropped, never emitted, as vLLM's
    /// incremental detokenizer does: the text ends at the last complete character, streamed or
    /// not, instead of with a U+FFFD the model never produced.
    pub fn finish(&mut self) -> Detokenized {
        if self.stopped {
            return Detokenized {
                text: String::new(),
                stopped: true,
            };
        }
        // `pending` only ever holds the start of a character that may still complete: bytes
        // that can never become valid were already replaced by U+FFFD as they arrived.
        self.pending.clear();
        let text = std::mem::take(&mut self.held);
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
        let old = self.held.len();
        self.held.push_str(&decoded);
        // Earliest stop-string match in the held window that takes some of the new text (as
        // vLLM looks): held text never contains a match that started in already released text,
        // because any possible start was held back, and a match within the old held text
        // either ended the sequence then or came before `min_tokens` (one stop string inside
        // another, held as a possible start of the longer one).
        let hit = if self.armed {
            self.stop
                .iter()
                .filter_map(|s| {
                    let mut from = (old + 1).saturating_sub(s.len());
                    while !self.held.is_char_boundary(from) {
                        from -= 1;
                    }
                    self.held[from..]
                        .match_indices(s.as_str())
                        .map(|(pos, _)| from + pos)
                        .find(|&pos| pos + s.len() > old)
                        .map(|pos| (pos, s.len()))
                })
                .min_by_key(|&(pos, _)| pos)
        } else {
            None
        };
        if let Some((pos, len)) = hit {
            let end = if self.include_stop { pos + len } else { pos };
            let text = self.held[..end].to_string();
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
        // A character cut off by the end of the stream is held back, not rendered.
        let (out, _) = run(&[], &[b"z\xe2\x82"]);
        assert_eq!(out.concat(), "z");
        // Bytes that can never complete a character are replaced even at the very end.
        let (out, _) = run(&[], &[b"z\xe2\x82", b"q\xe2"]);
        assert_eq!(out.concat(), "z\u{FFFD}q");
    }

    /// SmolLM2's byte-level tokens split an emoji: generation that stops after its first bytes
    /// ends at the last complete character; a whole U+FFFD the model produced is kept.
    #[test]
    fn a_character_cut_off_at_the_end_is_held_back_with_real_tokens() {
        use switchyard_gpu::model::{default_model_path, load_model};
        let path = default_model_path("smollm2-135m");
        assert!(
            path.is_file(),
            "{} is missing: run `switchyard model fetch smollm2-135m`",
            path.display()
        );
        let tok = load_model(&path, &switchyard_gpu::progress::NoProgress)
            .expect("SmolLM2 loads")
            .tokenizer;
        let text = "Go 🚀";
        let ids = tok.encode(text, false).unwrap();
        let bytes: Vec<&[u8]> = ids.iter().map(|&i| tok.token_bytes(i).unwrap()).collect();
        // The first token that is not valid UTF-8 on its own starts the split emoji.
        let split = bytes
            .iter()
            .position(|b| std::str::from_utf8(b).is_err())
            .expect("the emoji is split over byte tokens");
        assert!(split + 1 < bytes.len(), "the emoji spans several tokens");
        for stop in [&[][..], &["never"][..]] {
            // Every prefix that ends inside the emoji: deltas joined equal the final text,
            // which is the text before the emoji, with no U+FFFD.
            for end in split + 1..bytes.len() {
                let (out, _) = run(stop, &bytes[..end]);
                let joined = out.concat();
                assert_eq!(joined, "Go ", "stop {stop:?}, {end} tokens");
                assert!(!joined.contains('\u{FFFD}'));
            }
            let (out, _) = run(stop, &bytes);
            assert_eq!(out.concat(), text);
        }
        // A generated U+FFFD is a complete character: it stays.
        let real = "ok \u{FFFD}";
        let ids = tok.encode(real, false).unwrap();
        let bytes: Vec<&[u8]> = ids.iter().map(|&i| tok.token_bytes(i).unwrap()).collect();
        assert_eq!(run(&[], &bytes).0.concat(), real);
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

    #[test]
    fn an_included_stop_string_ends_the_text() {
        let mut d = IncrementalDetokenizer::new(vec!["END".into(), "lo".into()]).include_stop(true);
        let first = d.push(b"hello E");
        assert_eq!((first.text.as_str(), first.stopped), ("hello", true));
        let mut d = IncrementalDetokenizer::new(vec!["END".into()]).include_stop(true);
        assert_eq!(d.push(b"a E").text, "a ");
        let r = d.push(b"ND b");
        assert_eq!((r.text.as_str(), r.stopped), ("END", true));
        assert_eq!(d.push(b"more").text, "");
    }

    #[test]
    fn a_disarmed_detokenizer_releases_stop_strings_as_text() {
        let mut d = IncrementalDetokenizer::new(vec!["..".into()]);
        d.arm(false);
        let mut text = String::new();
        assert!(!d.push_into(b"a.. b.", &mut text));
        // The possible start of a stop string is still held back.
        assert_eq!(text, "a.. b");
        d.arm(true);
        assert!(d.push_into(b".c", &mut text));
        assert_eq!(text, "a.. b");
        assert!(d.is_stopped());
        // One stop string inside another, whole before min_tokens and held as the possible
        // start of the longer: it does not end the sequence once armed (vLLM).
        let mut d = IncrementalDetokenizer::new(vec!["..".into(), "...".into()]);
        let mut text = String::new();
        d.arm(false);
        assert!(!d.push_into(b"a..", &mut text));
        d.arm(true);
        assert!(!d.push_into(b"x", &mut text));
        assert_eq!(text, "a..x");
    }
}
