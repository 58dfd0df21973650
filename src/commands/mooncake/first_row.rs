//! The start check of a Mooncake trace: the first row that [`read_rows`] will read, found and
//! checked in the file's beginning while the file is read, by `read_rows`' own rules.
//!
//! [`read_rows`]: super::read_rows

use std::path::Path;

use super::{no_rows, shown_char};

/// The start check of a Mooncake trace as [`read_rows`] reads it, fed the file's beginning as
/// it is read, so that a file that cannot be the trace is refused before the rest of it (up
/// to a GiB) is read, and before a model loads: the first row `read_rows` reads must begin
/// with `{` (as every row must), and there must be one. Its rules are `read_rows`' own: a
/// byte order mark at the start is left out, a blank line (whitespace only) is no row, and
/// the first `skip` rows (`--skip-rows`) are counted, not read (of any length, any content).
/// Each byte is looked at once (a character cut by the end of what was read so far, again
/// with its end), and the check stops at that row's first character that is not whitespace.
/// Text that is not UTF-8 before that point is refused there, as the whole file would be.
///
/// [`read_rows`]: super::read_rows
#[derive(Debug)]
pub(in crate::commands) struct FirstRowCheck {
    /// Rows to count before the one checked.
    skip: usize,
    /// Rows counted so far.
    skipped: usize,
    /// Bytes of the file looked at so far (a byte order mark included).
    seen: usize,
    /// The 1-based line at `seen`.
    line: usize,
    /// Whether that line so far holds a character that is not whitespace: it is a row, not a
    /// blank line.
    line_has_text: bool,
}

impl FirstRowCheck {
    /// The check of a file read with `--skip-rows skip`.
    pub(in crate::commands) fn new(skip: usize) -> Self {
        Self {
            skip,
            skipped: 0,
            seen: 0,
            line: 1,
            line_has_text: false,
        }
    }

    /// Looks at `bytes`, the beginning of the file at `path` read so far (`all`: the whole
    /// file), from where the last call stopped: `true` once the first row read begins as a
    /// JSON object, `false` while more must be read to tell; an error naming the line when
    /// the file cannot be a trace that `read_rows` reads.
    pub(in crate::commands) fn check(
        &mut self,
        path: &Path,
        bytes: &[u8],
        all: bool,
    ) -> anyhow::Result<bool> {
        const BOM: &[u8] = "\u{feff}".as_bytes();
        if self.seen == 0 {
            if bytes.starts_with(BOM) {
                self.seen = BOM.len();
            } else if !all && BOM.starts_with(bytes) {
                return Ok(false);
            }
        }
        let rest = bytes.get(self.seen..).unwrap_or_default();
        let (valid, cut) = match std::str::from_utf8(rest) {
            Ok(text) => (text, None),
            Err(e) => (
                std::str::from_utf8(&rest[..e.valid_up_to()]).unwrap_or_default(),
                Some(e.error_len()),
            ),
        };
        let mut at = 0;
        while at < valid.len() {
            if self.line_has_text {
                // A row counted by --skip-rows: only where it ends matters.
                match valid[at..].find('\n') {
                    Some(end) => at += end,
                    None => {
                        at = valid.len();
                        break;
                    }
                }
            }
            let Some(c) = valid[at..].chars().next() else {
                break;
            };
            at += c.len_utf8();
            if c == '\n' {
                if self.line_has_text {
                    self.skipped += 1;
                }
                self.line += 1;
                self.line_has_text = false;
            } else if !c.is_whitespace() {
                if self.skipped == self.skip {
                    return self.first_character(path, c);
                }
                self.line_has_text = true;
            }
        }
        self.seen += at;
        match cut {
            // A character whose end is not read yet.
            Some(None) if !all => Ok(false),
            Some(_) => anyhow::bail!("{}:{}: not UTF-8 text", path.display(), self.line),
            None if !all => Ok(false),
            None => {
                // The last line, with no line end.
                if self.line_has_text {
                    self.skipped += 1;
                }
                anyhow::bail!("{}", no_rows(path, self.skipped, self.skip))
            }
        }
    }

    /// The verdict on `c`, the first character of the first row read (on the current line)
    /// that is not whitespace.
    fn first_character(&self, path: &Path, c: char) -> anyhow::Result<bool> {
        if c == '{' {
            return Ok(true);
        }
        let what = if self.skip == 0 {
            format!("its first character is {}", shown_char(c))
        } else {
            format!(
                "the first row after the {} that --skip-rows skips begins with {}",
                self.skip,
                shown_char(c)
            )
        };
        anyhow::bail!(
            "{}:{}: not JSON Lines of objects ({what}, not `{{`)",
            path.display(),
            self.line
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::mooncake::read_rows;
    use crate::commands::mooncake::tests::SHAPE;

    /// [`FirstRowCheck`] fed `text` in pieces of `piece` bytes, as [`read_dataset`] feeds it
    /// what it has read (the whole file last, said to be all of it).
    ///
    /// [`read_dataset`]: crate::commands::bench_serve::read_dataset
    fn first_row(text: &str, skip: usize, piece: usize) -> anyhow::Result<bool> {
        let mut check = FirstRowCheck::new(skip);
        let bytes = text.as_bytes();
        for end in (0..bytes.len()).step_by(piece) {
            if check.check(Path::new("mc.jsonl"), &bytes[..end], false)? {
                return Ok(true);
            }
        }
        check.check(Path::new("mc.jsonl"), bytes, true)
    }

    /// The start check refuses a file exactly where reading its first row refuses it (the
    /// row named by its line), refuses a file without a row with the same words, and
    /// passes every file whose first row begins as an object: over every text of up to five
    /// pieces of lines, blanks (ASCII, Unicode), a byte order mark, a row, text that is not
    /// a row, and every `--skip-rows` up to 3, fed whole and a byte at a time.
    #[test]
    fn the_start_check_agrees_with_the_rows_read() {
        const ROW: &str = r#"{"timestamp": 0, "input_length": 8, "output_length": 1}"#;
        let parts = ["\n", " ", "\r", "\u{a0}", "\u{feff}", "x", "{", ROW];
        let mut texts = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..5 {
            last = last
                .iter()
                .flat_map(|t| parts.iter().map(move |p| format!("{t}{p}")))
                .collect();
            texts.extend(last.iter().cloned());
        }
        let mut refused_early = 0;
        for text in &texts {
            for skip in 0..=3 {
                let read = read_rows(Path::new("mc.jsonl"), text, SHAPE, skip, 1)
                    .map_err(|e| format!("{e:#}"));
                let whole = first_row(text, skip, usize::MAX).map_err(|e| e.to_string());
                let bytewise = first_row(text, skip, 1).map_err(|e| e.to_string());
                assert_eq!(whole, bytewise, "{text:?} --skip-rows {skip}");
                match (&whole, &read) {
                    (Ok(true), Ok(_)) => {}
                    (Ok(true), Err(e)) => assert!(
                        !e.contains("has no rows") && !e.contains("it begins with"),
                        "{text:?} --skip-rows {skip}: passed, but the run says {e}"
                    ),
                    (Err(early), Err(e)) if early.contains("has no rows") => {
                        assert_eq!(early, e, "{text:?} --skip-rows {skip}")
                    }
                    (Err(early), Err(e)) => {
                        let line = early.split(':').nth(1).unwrap_or_default();
                        assert!(
                            e.starts_with(&format!("mc.jsonl:{line}: field <json>: not a JSON"))
                                && e.contains("it begins with"),
                            "{text:?} --skip-rows {skip}: {early} but the run says {e}"
                        );
                        refused_early += 1;
                    }
                    _ => panic!("{text:?} --skip-rows {skip}: {whole:?} but {read:?}"),
                }
            }
        }
        assert!(refused_early > 1000, "{refused_early}");
    }

    /// `--skip-rows`: junk among the rows skipped passes the start check, the first row read
    /// is the one checked and named; a file that is not UTF-8 is refused where that shows.
    #[test]
    fn the_start_check_looks_at_the_first_row_read() {
        let text = "TIMESTAMP,ContextTokens\n\n{\"timestamp\": 0}\nnot json\n";
        assert!(first_row(text, 1, usize::MAX).unwrap());
        assert!(first_row(text, 1, 3).unwrap());
        let e = first_row(text, 0, usize::MAX).unwrap_err().to_string();
        assert_eq!(
            e,
            "mc.jsonl:1: not JSON Lines of objects (its first character is `T`, not `{`)"
        );
        let e = first_row(text, 2, 5).unwrap_err().to_string();
        assert_eq!(
            e,
            "mc.jsonl:4: not JSON Lines of objects (the first row after the 2 that \
             --skip-rows skips begins with `n`, not `{`)"
        );
        let e = first_row("\u{a0}\u{3000}\n\u{e9}", 0, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("(its first character is U+00E9, not `{`)"),
            "{e}"
        );
        assert!(e.starts_with("mc.jsonl:2:"), "{e}");
        let e = first_row("skipped\n", 3, 1).unwrap_err().to_string();
        assert_eq!(
            e,
            "mc.jsonl has no rows: it ends after 1, before the 3 that --skip-rows skips"
        );
        // A skipped row of any length is counted; only a row's end is looked for in it.
        let long = format!("{}\n{{}}", "x".repeat(3 << 20));
        assert!(first_row(&long, 1, 64 << 10).unwrap());
        let mut bytes = b"ok\n\xff{}\n".to_vec();
        let mut check = FirstRowCheck::new(1);
        let e = check
            .check(Path::new("mc.jsonl"), &bytes, false)
            .unwrap_err();
        assert_eq!(e.to_string(), "mc.jsonl:2: not UTF-8 text");
        // A character cut by the end of what was read waits for the rest.
        bytes = "\u{3000}{".as_bytes().to_vec();
        let mut check = FirstRowCheck::new(0);
        assert!(!check
            .check(Path::new("mc.jsonl"), &bytes[..2], false)
            .unwrap());
        assert!(check.check(Path::new("mc.jsonl"), &bytes, false).unwrap());
        let mut check = FirstRowCheck::new(0);
        assert!(check
            .check(Path::new("mc.jsonl"), &bytes[..2], true)
            .is_err());
    }
}
