//! The known name nearest a misspelt one, for "did you mean" hints in errors about policy
//! names and parameters (`slo-awre`, `step_overhed_ms`).

/// The name of `known` that `name` most likely misspells: the one fewest single-character
/// edits away (insertions, deletions, substitutions, ignoring ASCII case), when that is at
/// most a third of its length (one edit at least); the first such name on a tie. `None`
/// when none is that close, or `name` is one of them. Costs at most a few thousand steps
/// whatever `name`'s length: a name far longer than any known one is not compared.
pub(crate) fn nearest<'k>(name: &str, known: &[&'k str]) -> Option<&'k str> {
    if known.contains(&name) {
        return None;
    }
    let name: Vec<char> = name.chars().map(|c| c.to_ascii_lowercase()).collect();
    let mut best: Option<(usize, &'k str)> = None;
    for &k in known {
        let candidate: Vec<char> = k.chars().map(|c| c.to_ascii_lowercase()).collect();
        let limit = (candidate.len() / 3).max(1);
        if name.len().abs_diff(candidate.len()) > limit {
            continue;
        }
        let d = edit_distance(&name, &candidate);
        if d <= limit && best.is_none_or(|(b, _)| d < b) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| k)
}

/// Levenshtein distance between `a` and `b`, one row at a time.
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if ca == cb {
                diagonal
            } else {
                1 + diagonal.min(above).min(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

/// ` (did you mean `x`?)` when [`nearest`] finds `x`, else nothing: for the end of the
/// clause that names `name` as unknown.
pub(crate) fn did_you_mean(name: &str, known: &[&str]) -> String {
    nearest(name, known)
        .map(|k| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default()
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
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        let d = |a: &str, b: &str| {
            let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
            edit_distance(&a, &b)
        };
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("flaw", "lawn"), 2);
        assert_eq!(d("same", "same"), 0);
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
}
