//! What the output readers ([`super::reasoning`], [`super::tools`]) share: text they hold
//! back while it may still open a tag, and how much whitespace they hold.

/// Most whitespace a reader holds back (before `<think>` or a call, after `</think>`, between
/// the parts of calls): longer runs are text.
pub(super) const MAX_HELD_SPACE: usize = 256;

/// How much of the end of `text` may be the start of `tag` (a proper prefix of it).
pub(super) fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// The length of `text`'s leading ASCII whitespace.
pub(super) fn leading_space(text: &str) -> usize {
    text.len()
        - text
            .trim_start_matches(|c: char| c.is_ascii_whitespace())
            .len()
}

/// `text` without its trailing ASCII whitespace (a cut there is always on a character
/// boundary).
pub(super) fn trim_space_end(text: &str) -> &str {
    text.trim_end_matches(|c: char| c.is_ascii_whitespace())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_tag_is_a_proper_prefix_at_the_end() {
        assert_eq!(partial_tag("abc<thi", "<think>"), 4);
        assert_eq!(partial_tag("abc<", "<think>"), 1);
        assert_eq!(partial_tag("abc<think>", "<think>"), 0);
        assert_eq!(partial_tag("abc", "<think>"), 0);
        assert_eq!(partial_tag("", "<think>"), 0);
        assert_eq!(partial_tag("é<tool_c", "<tool_call>"), 7);
    }

    #[test]
    fn whitespace_is_measured_in_bytes_of_ascii_space() {
        assert_eq!(leading_space(" \n\tx "), 3);
        assert_eq!(leading_space("\u{a0}x"), 0);
        assert_eq!(trim_space_end("x \n"), "x");
        assert_eq!(trim_space_end("x\u{a0}"), "x\u{a0}");
    }
}
