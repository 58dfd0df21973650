//! The known name nearest a misspelt one, for "did you mean" hints in errors: policy names and
//! parameters in `policies` (`slo-awre`, `step_overhed_ms`), and the fields and variants that
//! serde reports unknown in a configuration or a simulation spec in `config` (`prot`, `cdua`).
//!
//! The distance is the `strsim` crate's (clap builds it for its own suggestions): optimal
//! string alignment, Levenshtein's edits plus the swap of two neighbouring characters as one,
//! the commonest typo (`prot` for `port`, `cdua` for `cuda`, which Levenshtein counts as two
//! edits, too many for a name of four letters). This file adds the rule of what is close
//! enough, and reads serde's messages. One file included (`#[path]`) by `config` and `policies`, as
//! `support/short_number.rs` is: neither depends on the other, and a crate for these few
//! functions would be more than they are. Each crate uses what it needs of it.
#![allow(dead_code)]

/// The name of `known` that `name` most likely misspells: the one fewest single-character
/// edits away (insertions, deletions, substitutions and swaps of two neighbours, ignoring
/// ASCII case), when that is at
/// most a third of its length (one edit at least); the first such name on a tie. `None`
/// when none is that close, or `name` is one of them. Costs at most a few thousand steps
/// whatever `name`'s length: a name far longer than any known one is not compared (nor
/// counted past that length).
pub fn nearest<'k>(name: &str, known: &[&'k str]) -> Option<&'k str> {
    if known.contains(&name) {
        return None;
    }
    let longest = known.iter().map(|k| k.chars().count()).max()?;
    // No known name is within reach of a name longer than this.
    let reach = longest + (longest / 3).max(1);
    let len = name.chars().take(reach + 1).count();
    if len > reach {
        return None;
    }
    let name = name.to_ascii_lowercase();
    let mut best: Option<(usize, &'k str)> = None;
    for &k in known {
        let k_len = k.chars().count();
        let limit = (k_len / 3).max(1);
        if len.abs_diff(k_len) > limit {
            continue;
        }
        let d = strsim::osa_distance(&name, &k.to_ascii_lowercase());
        if d <= limit && best.is_none_or(|(b, _)| d < b) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| k)
}

/// ` (did you mean `x`?)` when [`nearest`] finds `x`, else nothing: for the end of the
/// clause that names `name` as unknown.
pub fn did_you_mean(name: &str, known: &[&str]) -> String {
    nearest(name, known)
        .map(|k| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default()
}

/// `message`, a deserializer's error, with [`did_you_mean`]'s hint after the list of known
/// names when it reports an unknown field or variant in serde's words ("unknown field `x`,
/// expected `a` or `b`", "... expected one of `a`, `b`, `c`", the same for "unknown
/// variant"); unchanged otherwise ("unknown field `x`, there are no fields", or no such
/// report). Whatever comes before (a path, "field `server`: ") or after (" at line 3 column
/// 5") the report is kept. Linear in the message's length.
pub fn with_did_you_mean(message: &str) -> String {
    const SEPARATOR: &str = "`, expected ";
    for report in ["unknown field `", "unknown variant `"] {
        let Some(open) = message.find(report) else {
            continue;
        };
        let name_at = open + report.len();
        // The known names hold no backquote, so the last separator is the one after the
        // name, whatever the name holds.
        let Some(sep) = message[name_at..].rfind(SEPARATOR) else {
            continue;
        };
        let name = &message[name_at..name_at + sep];
        let list_at = name_at + sep + SEPARATOR.len();
        let list = &message[list_at..];
        let body = list.strip_prefix("one of ").unwrap_or(list);
        let Some((known, len)) = quoted_names(body) else {
            continue;
        };
        let end = list_at + (list.len() - body.len()) + len;
        let hint = did_you_mean(name, &known);
        return format!("{}{hint}{}", &message[..end], &message[end..]);
    }
    message.to_string()
}

/// The names of serde's list at the start of `text` (`` `a` ``, `` `a` or `b` ``, `` `a`, `b`,
/// `c` ``) and the length of the list; `None` when `text` does not start with one.
fn quoted_names(text: &str) -> Option<(Vec<&str>, usize)> {
    let mut names = Vec::new();
    let mut at = 0;
    loop {
        let rest = text[at..].strip_prefix('`')?;
        let close = rest.find('`')?;
        names.push(&rest[..close]);
        at += 1 + close + 1;
        match [", `", " or `"]
            .iter()
            .find(|s| text[at..].starts_with(**s))
        {
            Some(s) => at += s.len() - 1,
            None => return Some((names, at)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICIES: &[&str] = &[
        "fcfs",
        "priority",
        "slo-aware",
        "chunked-prefill",
        "fair-share",
        "prefix-aware",
        "mlfq",
    ];

    #[test]
    fn the_distance_counts_insertions_deletions_substitutions_and_swaps_ignoring_case() {
        let d = |a: &str, b: &str| strsim::osa_distance(a, b);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("flaw", "lawn"), 2);
        assert_eq!(d("same", "same"), 0);
        assert_eq!(d("prot", "port"), 1);
        // Case aside, `FCFS` is `fcfs`; a swap of two neighbours is one edit, so a name of
        // four letters with one swap is within reach, one of two swaps is not.
        assert_eq!(nearest("FCFS", &["fcfs"]), Some("fcfs"));
        assert_eq!(nearest("cdua", &["auto", "cpu", "cuda"]), Some("cuda"));
        assert_eq!(nearest("prot", &["host", "port"]), Some("port"));
        assert_eq!(nearest("oprt", &["port"]), Some("port"));
        assert_eq!(nearest("rpot", &["port"]), None);
    }

    #[test]
    fn a_near_miss_gets_the_name_it_misspells() {
        for (typo, meant) in [
            ("slo-awre", "slo-aware"),
            ("slo_aware", "slo-aware"),
            ("FCFS", "fcfs"),
            ("fcf", "fcfs"),
            ("priorty", "priority"),
            ("fair-shares", "fair-share"),
            ("chunked_prefil", "chunked-prefill"),
        ] {
            assert_eq!(nearest(typo, POLICIES), Some(meant), "{typo}");
        }
        let params = ["step_overhead_ms", "prefill_us_per_token", "pace_fraction"];
        assert_eq!(
            nearest("step_overhed_ms", &params),
            Some("step_overhead_ms")
        );
    }

    #[test]
    fn a_name_far_from_every_known_one_gets_none() {
        for name in ["nope", "round-robin", "", "x", "lottery", "mlfqfcfs"] {
            assert_eq!(nearest(name, POLICIES), None, "{name}");
        }
        assert_eq!(nearest("fcfs", POLICIES), None, "a known name is no typo");
        assert_eq!(nearest("anything", &[]), None);
        // Far longer than any known name: not compared at all.
        assert_eq!(nearest(&"a".repeat(1 << 20), POLICIES), None);
    }

    #[test]
    fn the_hint_reads_as_a_clause() {
        assert_eq!(
            did_you_mean("slo-awre", POLICIES),
            " (did you mean `slo-aware`?)"
        );
        assert_eq!(did_you_mean("nope", POLICIES), "");
    }

    /// Serde's message shapes, with what comes before and after them.
    #[test]
    fn serdes_unknown_names_get_the_nearest_known_one() {
        let check = |message: &str, expect: &str| {
            assert_eq!(with_did_you_mean(message), expect, "{message}");
        };
        check(
            "server: unknown field `prot`, expected one of `host`, `port`, `api_keys` at line 2 column 11",
            "server: unknown field `prot`, expected one of `host`, `port`, `api_keys` (did you mean `port`?) at line 2 column 11",
        );
        check(
            "unknown field `nmae`, expected `name` or `params`",
            "unknown field `nmae`, expected `name` or `params` (did you mean `name`?)",
        );
        check(
            "unknown field `nam`, expected `name`",
            "unknown field `nam`, expected `name` (did you mean `name`?)",
        );
        check(
            "model.backend: unknown variant `cdua`, expected one of `auto`, `cpu`, `cuda`",
            "model.backend: unknown variant `cdua`, expected one of `auto`, `cpu`, `cuda` (did you mean `cuda`?)",
        );
        check(
            "field `server`: unknown field `PORT`, expected `host` or `port`",
            "field `server`: unknown field `PORT`, expected `host` or `port` (did you mean `port`?)",
        );
        // Nothing close, nothing known, or no such report: unchanged.
        for kept in [
            "unknown field `colour`, expected `host` or `port` at line 1 column 1",
            "unknown field `x`, there are no fields",
            "unknown variant `x`, there are no variants",
            "invalid type: string \"a\", expected u32",
            "unknown field `x`, expected something else",
            "unknown field `x",
            "",
        ] {
            check(kept, kept);
        }
        // A name holding the separator is read whole, as the last separator ends it.
        check(
            "unknown field `a`, expected `b``, expected `host` or `port`",
            "unknown field `a`, expected `b``, expected `host` or `port`",
        );
        check(
            "unknown field `pot`, expected `x`, expected `host` or `port`",
            "unknown field `pot`, expected `x`, expected `host` or `port`",
        );
    }

    /// A key of a megabyte costs a pass over it, not a comparison with every known name.
    #[test]
    fn a_huge_unknown_name_is_not_compared() {
        let name = "p".repeat(1 << 20);
        let message = format!("unknown field `{name}`, expected `host` or `port`");
        assert_eq!(with_did_you_mean(&message), message);
    }
}
