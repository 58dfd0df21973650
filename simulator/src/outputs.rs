//! The output directory of a run: which files a run writes there, and the manifest that lets
//! the next run into the same directory remove the files of this one that it does not rewrite.
//!
//! A run writes fixed names (the summary and the plots, always overwritten) and one
//! `requests-<label>.jsonl` per policy, so a later run with other policies would leave the
//! earlier run's per-request files beside its own. The directory must hold exactly the last
//! run's outputs, yet a user's own files there (notes, a trace, a `requests-mine.jsonl` of
//! their own) must never be touched: a name pattern alone cannot tell those apart. So every run
//! records the names it writes in `simulate-manifest.json`, and a run removes only the files an
//! earlier manifest lists that it does not write itself. The manifest is written before any
//! output (listing the earlier files and this run's together) and again after the last one
//! (this run's alone), so a run that stops halfway leaves a manifest covering every file it
//! may have written. Names read from a manifest are used only when they are names a run writes
//! (no path separators), so an edited manifest cannot reach outside the directory or past the
//! simulator's own file names. A directory written before manifests existed has its
//! `summary.json`, which names its policies: their `requests-<label>.jsonl` are removed then.
//! Each output is written under a temporary name (`<name>.tmp`) and renamed over its own once
//! whole ([`write_replacing`]), so a run stopped while writing (Ctrl-C) leaves no output cut
//! short; the next run removes such a temporary file of a name it or the manifest lists.

use crate::error::SimError;
use crate::report::Comparison;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::Path;
use switchyard_config::ReadError;

/// The manifest's file name.
pub const MANIFEST: &str = "simulate-manifest.json";

/// What `write` says in the manifest's `written_by`, to tell it from a file of the same name
/// that is not ours.
const WRITTEN_BY: &str = "switchyard simulate";

/// Largest manifest read: a run lists at most a few hundred names (its policies' per-request
/// files, its tiers' plots), a few KiB.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Largest `summary.json` read to find an earlier run's files (a directory written before
/// manifests): far above what a run of [`crate::spec::MAX_POLICIES`] policies writes.
const MAX_SUMMARY_BYTES: u64 = 64 << 20;

/// The comparison as JSON.
pub const SUMMARY_JSON: &str = "summary.json";
/// The comparison as the table `simulate` prints.
pub const SUMMARY_TXT: &str = "summary.txt";
/// Time to first token, a CDF per policy.
pub const TTFT_CDF_SVG: &str = "ttft_cdf.svg";
/// End-to-end latency, a CDF per policy.
pub const E2E_CDF_SVG: &str = "e2e_cdf.svg";
/// Waiting requests over time.
pub const QUEUE_SVG: &str = "queue.svg";
/// KV cache usage over time.
pub const KV_USAGE_SVG: &str = "kv_usage.svg";

/// The names every run writes, whatever its policies.
pub const FIXED_FILES: [&str; 6] = [
    SUMMARY_JSON,
    SUMMARY_TXT,
    TTFT_CDF_SVG,
    E2E_CDF_SVG,
    QUEUE_SVG,
    KV_USAGE_SVG,
];

/// The per-request file of the policy labelled `label`.
pub fn requests_file(label: &str) -> String {
    format!("requests-{label}.jsonl")
}

/// The latency a per-tier plot shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierMetric {
    /// Time to first token.
    Ttft,
    /// Time per output token.
    Tpot,
}

impl TierMetric {
    /// The file name's prefix.
    fn prefix(self) -> &'static str {
        match self {
            TierMetric::Ttft => "ttft_cdf-tier",
            TierMetric::Tpot => "tpot_cdf-tier",
        }
    }
}

/// Most characters of a tier's name a per-tier plot's file name repeats.
pub const TIER_SLUG_CHARS: usize = 32;

/// The per-tier plot of `metric` for the tier `name`, the `index`th (from 0) of the spec's
/// tiers in name order: `ttft_cdf-tier<index>-<slug>.svg` (or `tpot_cdf-...`), the slug the
/// name's first [`TIER_SLUG_CHARS`] characters with each one outside `[A-Za-z0-9_-]`
/// replaced by `_`. Tier names are free-form labels of up to 64 bytes in a simulation spec
/// (`/`, `..`, spaces, any Unicode), so the name alone could not be a file name: the index
/// makes it unique and the slug readable, and `summary.json`'s `tier_plots` maps each file
/// to its tier.
pub fn tier_plot_file(metric: TierMetric, index: usize, name: &str) -> String {
    let slug: String = name
        .chars()
        .take(TIER_SLUG_CHARS)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{}{index}-{slug}.svg", metric.prefix())
}

/// Whether `name` is one a [`tier_plot_file`] can be, of a tier index below
/// `crate::spec::MAX_LABELS`.
fn is_tier_plot_name(name: &str) -> bool {
    [TierMetric::Ttft, TierMetric::Tpot].iter().any(|m| {
        name.strip_prefix(m.prefix())
            .and_then(|n| n.strip_suffix(".svg"))
            .and_then(|n| n.split_once('-'))
            .is_some_and(|(index, slug)| {
                (1..=3).contains(&index.len())
                    && index.bytes().all(|b| b.is_ascii_digit())
                    && index.parse::<usize>().is_ok_and(|i| {
                        i < crate::spec::MAX_LABELS && (i == 0 || !index.starts_with('0'))
                    })
                    && (1..=TIER_SLUG_CHARS).contains(&slug.len())
                    && slug
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
    })
}

/// Whether `name` is a file name a run writes: one of [`FIXED_FILES`], a
/// [`requests_file`] of a valid policy label or a [`tier_plot_file`].
fn is_output_name(name: &str) -> bool {
    FIXED_FILES.contains(&name)
        || name
            .strip_prefix("requests-")
            .and_then(|n| n.strip_suffix(".jsonl"))
            .is_some_and(crate::spec::valid_label)
        || is_tier_plot_name(name)
}

/// The manifest's contents.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    /// Always [`WRITTEN_BY`].
    written_by: String,
    /// The file names (in the directory) the run wrote.
    files: BTreeSet<String>,
}

/// The files a run wrote into its directory and those of an earlier run it removed, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputFiles {
    /// Written by this run, the manifest included.
    pub written: Vec<String>,
    /// Left by an earlier run and removed, as this run does not write them.
    pub removed: Vec<String>,
}

/// The files an earlier run recorded in `dir`: its manifest's, or for a directory written
/// before manifests, the per-request files of the policies its `summary.json` names. A
/// manifest that is not one `switchyard simulate` wrote is an error: writing ours would
/// overwrite it.
fn earlier_files(dir: &Path) -> Result<BTreeSet<String>, SimError> {
    let path = dir.join(MANIFEST);
    match switchyard_config::read_bytes(&path, MAX_MANIFEST_BYTES) {
        Ok(bytes) => {
            let not_ours = || {
                SimError::io(
                    &path,
                    std::io::Error::other(
                        "not a manifest switchyard simulate wrote, and a run would overwrite \
                         it; move it, or give --out another directory",
                    ),
                )
            };
            let m: Manifest = serde_json::from_slice(&bytes).map_err(|_| not_ours())?;
            if m.written_by != WRITTEN_BY {
                return Err(not_ours());
            }
            Ok(m.files.into_iter().filter(|n| is_output_name(n)).collect())
        }
        Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            // Only a summary.json that reads as ours counts; anything else names nothing
            // (one larger than any a run writes, or not a regular file, is not read).
            let summary = switchyard_config::read_bytes(&dir.join(SUMMARY_JSON), MAX_SUMMARY_BYTES);
            let policies = summary
                .ok()
                .and_then(|s| serde_json::from_slice::<Comparison>(&s).ok())
                .map(|c| c.policies)
                .unwrap_or_default();
            Ok(policies
                .iter()
                .map(|p| requests_file(&p.policy))
                .filter(|n| is_output_name(n))
                .collect())
        }
        Err(ReadError::Io(e)) => Err(SimError::io(&path, e)),
        Err(ReadError::Invalid(why)) => Err(SimError::io(
            &path,
            std::io::Error::other(format!(
                "{why}, not a manifest switchyard simulate wrote (it lists file names, a few \
                 KiB); move it, or give --out another directory"
            )),
        )),
    }
}

/// Writes the manifest listing `files`, through a temporary file renamed over it so that it is
/// never seen half written.
fn write_manifest(dir: &Path, files: &BTreeSet<String>) -> Result<(), SimError> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let m = Manifest {
        written_by: WRITTEN_BY.into(),
        files: files.clone(),
    };
    let text = serde_json::to_string_pretty(&m)
        .map_err(|e| SimError::io(&path, std::io::Error::other(e)))?;
    std::fs::write(&tmp, text + "\n")
        .map_err(|e| naming_output(SimError::io(&tmp, e), &tmp, &path))?;
    std::fs::rename(&tmp, &path).map_err(|e| SimError::io(&path, e))
}

/// `e`, an error of writing the temporary file `tmp` of the output `path`, as the user sees
/// it: about `path`, the file they asked for, with `tmp` named as the detail it is. An error
/// about another file is left as it is.
fn naming_output(e: SimError, tmp: &Path, path: &Path) -> SimError {
    let detail = format!(
        "writing its temporary file {} (renamed over it once whole)",
        tmp.file_name().unwrap_or(tmp.as_os_str()).to_string_lossy()
    );
    match e {
        SimError::Io { path: p, error } if p == tmp => SimError::Io {
            path: path.to_path_buf(),
            error: std::io::Error::new(error.kind(), format!("{detail}: {error}")),
        },
        SimError::Plot { path: p, message } if p == tmp => SimError::Plot {
            path: path.to_path_buf(),
            message: format!("{detail}: {message}"),
        },
        other => other,
    }
}

/// The name an output is written under before it is renamed over its own.
fn partial_name(name: &str) -> String {
    format!("{name}.tmp")
}

/// Writes the output `name` of `dir` through `write`, which writes the file at the path it is
/// given: a temporary file beside it, renamed over `name` once complete, so that a run stopped
/// part way (Ctrl-C while writing tens of MiB of per-request JSONL) leaves each output either
/// whole, this run's or the earlier one's, never cut short. A temporary file a stopped run
/// leaves behind is removed by the next run's [`prepare`]; one whose `write` fails is removed
/// at once, and the error names `name` (the temporary file as a detail).
pub fn write_replacing(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&Path) -> Result<(), SimError>,
) -> Result<(), SimError> {
    let tmp = dir.join(partial_name(name));
    let path = dir.join(name);
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(naming_output(e, &tmp, &path));
    }
    std::fs::rename(&tmp, &path).map_err(|e| SimError::io(&path, e))
}

/// Refuses `dir` as a run's output directory where [`prepare`] would, once the run is done:
/// a path that is not a directory, or one holding a manifest that `simulate` did not write.
/// Called before a run too, so that a long simulation does not end in that error.
pub fn check(dir: &Path) -> Result<(), SimError> {
    if dir.exists() && !dir.is_dir() {
        // create_dir_all's own answer, "File exists", reads as if the directory were in the way.
        return Err(SimError::io(
            dir,
            std::io::Error::other(
                "not a directory (the outputs go into the directory --out names)",
            ),
        ));
    }
    if dir.is_dir() {
        earlier_files(dir)?;
    }
    Ok(())
}

/// Prepares `dir` (created if needed) for a run that writes `files`: records them in the
/// manifest beside the earlier run's, then removes the earlier run's files that are not among
/// them, and the temporary files ([`write_replacing`]) of either that a stopped run left.
/// Returns the removed names (of outputs, not of temporary files); call [`finish`] once every
/// file is written.
pub fn prepare(dir: &Path, files: &BTreeSet<String>) -> Result<Vec<String>, SimError> {
    debug_assert!(files.iter().all(|n| is_output_name(n)));
    check(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| SimError::io(dir, e))?;
    let earlier = earlier_files(dir)?;
    write_manifest(dir, &earlier.union(files).cloned().collect())?;
    for name in earlier.union(files) {
        let tmp = dir.join(partial_name(name));
        if std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_file()) {
            std::fs::remove_file(&tmp).map_err(|e| SimError::io(&tmp, e))?;
        }
    }
    let mut removed = Vec::new();
    for name in earlier.difference(files) {
        let path = dir.join(name);
        // A directory or other non-file of that name was never ours to write: leave it.
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() || m.is_symlink() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(SimError::io(&path, e)),
        }
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(name.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(SimError::io(&path, e)),
        }
    }
    Ok(removed)
}

/// Records that `dir` holds exactly `files` (and the manifest).
pub fn finish(dir: &Path, files: &BTreeSet<String>) -> Result<(), SimError> {
    write_manifest(dir, files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> crate::scratch::ScratchDir {
        crate::scratch::ScratchDir::new(&format!("outputs-{tag}"))
    }

    /// `--out` naming a file is refused as not a directory, not as "File exists".
    #[test]
    fn an_out_path_that_is_a_file_is_named_as_not_a_directory() {
        let d = dir("out-file");
        let file = d.join("summary");
        std::fs::write(&file, "keep").unwrap();
        let err = prepare(&file, &names(&["summary.txt"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("summary: not a directory"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    }

    /// An output that cannot be written is named as the user knows it, not by the temporary
    /// name it is written under (which the message gives as a detail); an error about
    /// another file is left as it was.
    #[test]
    fn a_failed_write_names_the_output_not_its_temporary_file() {
        let d = dir("write-error");
        // A directory in the temporary file's place: writing it fails.
        std::fs::create_dir(d.join("summary.txt.tmp")).unwrap();
        let err = write_replacing(&d, "summary.txt", |p| {
            std::fs::write(p, "x").map_err(|e| SimError::io(p, e))
        })
        .unwrap_err()
        .to_string();
        let out = d.join("summary.txt").display().to_string();
        assert!(
            err.starts_with(&format!(
                "{out}: writing its temporary file summary.txt.tmp (renamed over it once \
                 whole): "
            )),
            "{err}"
        );
        assert!(!d.join("summary.txt").exists());
        let err = write_replacing(&d, "ttft_cdf.svg", |p| {
            Err(SimError::Plot {
                path: p.to_path_buf(),
                message: "no room".into(),
            })
        })
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            format!(
                "{}: plot: writing its temporary file ttft_cdf.svg.tmp (renamed over it once \
                 whole): no room",
                d.join("ttft_cdf.svg").display()
            )
        );
        let elsewhere = d.join("elsewhere");
        let err = write_replacing(&d, "queue.svg", |_| {
            Err(SimError::io(&elsewhere, std::io::Error::other("gone")))
        })
        .unwrap_err()
        .to_string();
        assert_eq!(err, format!("{}: gone", elsewhere.display()));
    }

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn run(d: &Path, files: &BTreeSet<String>) -> Vec<String> {
        let removed = prepare(d, files).unwrap();
        for f in files {
            std::fs::write(d.join(f), "x").unwrap();
        }
        finish(d, files).unwrap();
        removed
    }

    fn listing(d: &Path) -> BTreeSet<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    }

    #[test]
    fn a_second_run_removes_only_the_first_runs_files_it_does_not_rewrite() {
        let d = dir("second");
        std::fs::write(d.join("notes.txt"), "mine").unwrap();
        std::fs::write(d.join("requests-mine.jsonl"), "mine").unwrap();
        let first = names(&["summary.json", "requests-fcfs.jsonl", "requests-slo.jsonl"]);
        assert!(run(&d, &first).is_empty());
        let second = names(&["summary.json", "requests-fcfs.jsonl"]);
        assert_eq!(run(&d, &second), ["requests-slo.jsonl"]);
        assert_eq!(
            listing(&d),
            names(&[
                "notes.txt",
                "requests-mine.jsonl",
                "summary.json",
                "requests-fcfs.jsonl",
                MANIFEST
            ])
        );
    }

    #[test]
    fn a_run_that_stops_halfway_leaves_a_manifest_covering_both_runs() {
        let d = dir("halfway");
        run(&d, &names(&["requests-a.jsonl"]));
        prepare(&d, &names(&["requests-b.jsonl"])).unwrap();
        std::fs::write(d.join("requests-b.jsonl"), "x").unwrap();
        // No finish: the next run still knows requests-b.jsonl is ours.
        assert_eq!(run(&d, &names(&["summary.json"])), ["requests-b.jsonl"]);
        assert_eq!(listing(&d), names(&["summary.json", MANIFEST]));
    }

    #[test]
    fn an_edited_manifest_reaches_only_the_simulators_names_in_the_directory() {
        let d = dir("edited");
        for f in ["notes.txt", "requests-a.jsonl", "requests-a b.jsonl"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        std::fs::create_dir(d.join("queue.svg")).unwrap();
        let text = format!(
            r#"{{"written_by":"{WRITTEN_BY}","files":["notes.txt","../x","/etc/passwd",
            "requests-a.jsonl","requests-a b.jsonl","queue.svg"]}}"#
        );
        std::fs::write(d.join(MANIFEST), text).unwrap();
        assert_eq!(run(&d, &names(&["summary.txt"])), ["requests-a.jsonl"]);
        assert!(d.join("notes.txt").exists() && d.join("requests-a b.jsonl").exists());
        assert!(d.join("queue.svg").is_dir());
    }

    /// Tier names are free-form in a spec: the plots' file names stay plain, bounded and
    /// distinct whatever they are, and a later run recognises them as its own.
    #[test]
    fn tier_plot_names_are_safe_for_hostile_tier_names() {
        let long = "x".repeat(64);
        let cases = [
            (0, "premium", "ttft_cdf-tier0-premium.svg"),
            (1, "../../etc/passwd", "ttft_cdf-tier1-______etc_passwd.svg"),
            (2, "a/b", "ttft_cdf-tier2-a_b.svg"),
            (3, "a b", "ttft_cdf-tier3-a_b.svg"),
            (4, "..", "ttft_cdf-tier4-__.svg"),
            (5, "<script>&\"'", "ttft_cdf-tier5-_script____.svg"),
            (6, "gold\n\0", "ttft_cdf-tier6-gold__.svg"),
            (7, "prémium 🚀", "ttft_cdf-tier7-pr_mium__.svg"),
            (8, "-rf", "ttft_cdf-tier8--rf.svg"),
            (
                255,
                &long,
                "ttft_cdf-tier255-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx.svg",
            ),
        ];
        let mut seen = BTreeSet::new();
        for (index, tier, want) in cases {
            let name = tier_plot_file(TierMetric::Ttft, index, tier);
            assert_eq!(name, want, "{tier:?}");
            assert!(is_output_name(&name), "{name}");
            let tpot = tier_plot_file(TierMetric::Tpot, index, tier);
            assert_eq!(tpot, want.replacen("ttft", "tpot", 1));
            assert!(is_output_name(&tpot), "{tpot}");
            assert!(name.len() <= "ttft_cdf-tier255-".len() + TIER_SLUG_CHARS + 4);
            assert!(seen.insert(name));
        }
        // "a/b" and "a b" share a slug; their indices tell them apart.
        assert_ne!(
            tier_plot_file(TierMetric::Ttft, 2, "a/b"),
            tier_plot_file(TierMetric::Ttft, 3, "a b")
        );
        for not_ours in [
            "ttft_cdf-tier-premium.svg",
            "ttft_cdf-tier256-premium.svg",
            "ttft_cdf-tier01-premium.svg",
            "ttft_cdf-tier1-.svg",
            "ttft_cdf-tier1-a.b.svg",
            "ttft_cdf-tier1-a/b.svg",
            "ttft_cdf-tier1-premium.svg.bak",
            "e2e_cdf-tier1-premium.svg",
        ] {
            assert!(!is_output_name(not_ours), "{not_ours}");
        }
        let too_long = format!("ttft_cdf-tier1-{}.svg", "x".repeat(TIER_SLUG_CHARS + 1));
        assert!(!is_output_name(&too_long));
    }

    #[test]
    fn a_manifest_switchyard_did_not_write_is_refused_not_overwritten() {
        let d = dir("foreign");
        std::fs::write(d.join(MANIFEST), "{\"files\": []}").unwrap();
        let err = prepare(&d, &names(&["summary.json"])).unwrap_err();
        assert!(err.to_string().contains("not a manifest"), "{err}");
        assert_eq!(
            std::fs::read_to_string(d.join(MANIFEST)).unwrap(),
            "{\"files\": []}"
        );
    }

    /// A manifest is read to a bound: one past it (here ours, padded) is refused with why,
    /// not read whole (a manifest of a few KiB could not be that large).
    #[test]
    fn a_manifest_past_its_bound_is_refused_unread() {
        let d = dir("big-manifest");
        let ours = format!(
            "{{\"written_by\": \"{WRITTEN_BY}\", \"files\": []{}}}",
            " ".repeat(MAX_MANIFEST_BYTES as usize)
        );
        std::fs::write(d.join(MANIFEST), &ours).unwrap();
        let err = prepare(&d, &names(&["summary.json"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(MANIFEST)
                && err.contains(&format!("too large: more than {MAX_MANIFEST_BYTES} bytes"))
                && err.contains("not a manifest switchyard simulate wrote"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(d.join(MANIFEST)).unwrap(), ours);
    }

    /// A `summary.json` past its bound (here ours, padded) names nothing, as any other that
    /// does not read as ours: it is not read whole.
    #[test]
    fn a_summary_past_its_bound_names_nothing() {
        let d = dir("big-summary");
        let summary = Comparison {
            policies: vec![crate::report::PolicySummary {
                policy: "priority".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut text = serde_json::to_string(&summary).unwrap();
        text.push_str(&" ".repeat(MAX_SUMMARY_BYTES as usize));
        std::fs::write(d.join(SUMMARY_JSON), text).unwrap();
        std::fs::write(d.join("requests-priority.jsonl"), "x").unwrap();
        let files = names(&["summary.json", "requests-fcfs.jsonl"]);
        assert!(run(&d, &files).is_empty());
        assert!(d.join("requests-priority.jsonl").exists());
    }

    #[test]
    fn a_directory_from_before_manifests_gives_its_summarys_policies() {
        let d = dir("legacy");
        let summary = Comparison {
            policies: vec![
                crate::report::PolicySummary {
                    policy: "fcfs".into(),
                    ..Default::default()
                },
                crate::report::PolicySummary {
                    policy: "priority".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        summary.write(&d).unwrap();
        for f in [
            "requests-fcfs.jsonl",
            "requests-priority.jsonl",
            "requests-x.jsonl",
        ] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        let files = names(&["summary.json", "summary.txt", "requests-fcfs.jsonl"]);
        assert_eq!(run(&d, &files), ["requests-priority.jsonl"]);
        assert!(d.join("requests-x.jsonl").exists());
    }
}
