//! Which of cuBLASLt's candidate algorithms a large product runs: timed once per shape, and
//! remembered on disk so that later runs on the same GPU and library start with the choice.
//!
//! cuBLASLt's heuristic ranks up to eight algorithms per shape; its first choice is often not
//! the fastest at the token counts of large steps (measured on the H200 with
//! `gpu/reference/lt_tune.cu`: the output projection at 32768 tokens runs 1.15x faster on its
//! sixth candidate, the down projection at 2000 tokens 1.06x; CUDA_NOTES v6), and a winner at
//! one token count is no guide at another (2000 and 2048 tokens differ by up to 1.2x). So when a
//! product of at least [`TUNE_MIN_TOKENS`] tokens runs eagerly for the [`TUNE_AFTER_CALLS`]th
//! time, every candidate is timed on the real operands (see `lt.rs`) and the fastest kept.
//! Waiting for repeats leaves alone the token counts a server meets once (each tuning stalls its
//! step for a few times the product's length), and [`TUNE_BUDGET_MS`] bounds the stall a
//! process can ever spend. Smaller products (decode steps, CUDA graphs) keep the heuristic's
//! first choice: their kernels are a few microseconds, too short to time reliably, and graph
//! capture cannot time at all.
//!
//! The store is a cache file of plain lines `m n k c_f32 accumulate align_w align_a align_c
//! index`, named after the device, its compute capability and the cuBLASLt version (the
//! heuristic's ranking is a function of those and the shape, so an index means the same
//! algorithm on a later run). The file is input like any other: it is read up to
//! [`MAX_FILE_BYTES`], lines that do not parse or are out of range are skipped, and at most
//! [`super::lt::MAX_PLANS`] entries are kept. A file that cannot be read or written only costs
//! tuning again.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::lt::{PlanKey, MAX_PLANS};

/// Products with fewer tokens keep the heuristic's first choice.
pub(crate) const TUNE_MIN_TOKENS: usize = 1024;

/// Candidates asked of the heuristic (it returns at most eight for these products).
pub(crate) const MAX_CANDIDATES: usize = 8;

/// Longest tuning file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Largest dimension accepted from the file (products are bounded far below it).
const MAX_DIM: usize = 1 << 31;

/// The call of a shape at which its candidates are timed (earlier calls run the first choice).
pub(crate) const TUNE_AFTER_CALLS: u32 = 3;

/// Most milliseconds one process spends timing candidates.
pub(crate) const TUNE_BUDGET_MS: f32 = 20_000.0;

/// Where a plan stands with tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tuning {
    /// Its algorithm is final (remembered, tuned, or not tunable).
    Settled,
    /// Timed when called `calls_left` more times.
    Pending { calls_left: u32 },
}

impl Tuning {
    /// The state of a new plan for `key` with `candidates` algorithms.
    pub fn new(key: &PlanKey, remembered: bool, enabled: bool, candidates: usize) -> Tuning {
        if remembered || !enabled || candidates < 2 || key.n < TUNE_MIN_TOKENS {
            Tuning::Settled
        } else {
            Tuning::Pending {
                calls_left: TUNE_AFTER_CALLS,
            }
        }
    }

    /// Counts a call; true when this call should time the candidates, after which the plan is
    /// settled whatever the timing finds. A call while the stream captures is not counted and
    /// never times.
    pub fn on_call(&mut self, capturing: bool) -> bool {
        match self {
            Tuning::Pending { calls_left } if !capturing => {
                if *calls_left <= 1 {
                    *self = Tuning::Settled;
                    true
                } else {
                    *calls_left -= 1;
                    false
                }
            }
            _ => false,
        }
    }
}

/// What is left of [`TUNE_BUDGET_MS`].
#[derive(Debug)]
pub(crate) struct Budget {
    left_ms: f32,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            left_ms: TUNE_BUDGET_MS,
        }
    }
}

impl Budget {
    pub fn allows(&self) -> bool {
        self.left_ms > 0.0
    }

    pub fn spend(&mut self, ms: f32) {
        self.left_ms -= ms.max(0.0);
    }
}

/// The index of the fastest time (the lowest index among equals); `None` when none ran.
pub(crate) fn fastest(times: &[Option<f32>]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, t) in times.iter().enumerate() {
        if let Some(t) = *t {
            if t.is_finite() && best.is_none_or(|(_, b)| t < b) {
                best = Some((i, t));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// The tuning file's name for a device and cuBLASLt version (characters outside
/// `[A-Za-z0-9_-]` in the device name become `_`).
pub(crate) fn file_name(device: &str, cc: (i32, i32), cublaslt_version: usize) -> String {
    let slug: String = device
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "gemm-tune-{slug}-sm_{}{}-cublaslt{cublaslt_version}.txt",
        cc.0, cc.1
    )
}

fn format_line(key: &PlanKey, index: usize) -> String {
    let [aw, aa, ac] = key.align_log2;
    format!(
        "{} {} {} {} {} {aw} {aa} {ac} {index}\n",
        key.m,
        key.n,
        key.k,
        u8::from(key.c_f32),
        u8::from(key.accumulate)
    )
}

fn parse_line(line: &str) -> Option<(PlanKey, usize)> {
    let v: Vec<usize> = line
        .split_ascii_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let &[m, n, k, c_f32, accumulate, aw, aa, ac, index] = v.as_slice() else {
        return None;
    };
    let dims_ok = [m, n, k].iter().all(|&d| (1..=MAX_DIM).contains(&d));
    let align_ok = [aw, aa, ac].iter().all(|&a| a <= 8);
    if !dims_ok || !align_ok || c_f32 > 1 || accumulate > 1 || index >= MAX_CANDIDATES {
        return None;
    }
    Some((
        PlanKey {
            m,
            n,
            k,
            c_f32: c_f32 == 1,
            accumulate: accumulate == 1,
            align_log2: [aw as u8, aa as u8, ac as u8],
        },
        index,
    ))
}

/// Tuned choices: loaded from the file at `path` and appended to it.
#[derive(Debug, Default)]
pub(crate) struct TuneStore {
    path: Option<PathBuf>,
    entries: HashMap<PlanKey, usize>,
}

impl TuneStore {
    /// The choices in the file at `path` (none when it is missing or unreadable); `None` keeps
    /// them in memory only.
    pub fn open(path: Option<PathBuf>) -> Self {
        let mut entries = HashMap::new();
        if let Some(p) = &path {
            if let Some(text) = read_bounded(p) {
                for (key, index) in text.lines().filter_map(parse_line) {
                    if entries.len() >= MAX_PLANS && !entries.contains_key(&key) {
                        break;
                    }
                    entries.insert(key, index);
                }
            }
        }
        TuneStore { path, entries }
    }

    /// The remembered candidate index of `key`.
    pub fn get(&self, key: &PlanKey) -> Option<usize> {
        self.entries.get(key).copied()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Remembers `index` for `key` and appends it to the file (a write that fails is logged
    /// and otherwise ignored: the shape is tuned again next run).
    pub fn record(&mut self, key: PlanKey, index: usize) {
        if index >= MAX_CANDIDATES || (self.entries.len() >= MAX_PLANS && self.get(&key).is_none())
        {
            return;
        }
        self.entries.insert(key, index);
        let Some(p) = &self.path else { return };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?;
            f.write_all(format_line(&key, index).as_bytes())
        };
        if let Err(e) = write() {
            tracing::debug!(path = %p.display(), error = %e, "could not record a GEMM tuning choice");
        }
    }
}

/// The file's first [`MAX_FILE_BYTES`] as text (`None` if it cannot be read; a line cut by the
/// limit has fewer than nine fields, since the last is one digit, and is skipped).
fn read_bounded(p: &Path) -> Option<String> {
    let f = std::fs::File::open(p).ok()?;
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES).read_to_end(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(m: usize, n: usize, k: usize, c_f32: bool, accumulate: bool) -> PlanKey {
        PlanKey {
            m,
            n,
            k,
            c_f32,
            accumulate,
            align_log2: [8, 8, 4],
        }
    }

    #[test]
    fn only_large_products_are_tuned_and_only_on_an_eager_repeat() {
        let big = key(4096, TUNE_MIN_TOKENS, 4096, true, true);
        let pending = Tuning::Pending {
            calls_left: TUNE_AFTER_CALLS,
        };
        assert_eq!(Tuning::new(&big, false, true, 8), pending);
        // Remembered, turned off, nothing to choose from, or small: settled at once.
        assert_eq!(Tuning::new(&big, true, true, 8), Tuning::Settled);
        assert_eq!(Tuning::new(&big, false, false, 8), Tuning::Settled);
        assert_eq!(Tuning::new(&big, false, true, 1), Tuning::Settled);
        let small = key(4096, TUNE_MIN_TOKENS - 1, 4096, true, true);
        assert_eq!(Tuning::new(&small, false, true, 8), Tuning::Settled);
        // The TUNE_AFTER_CALLS-th eager call times; calls while capturing do not count.
        let mut t = pending;
        let mut fired = Vec::new();
        for call in 1..=TUNE_AFTER_CALLS + 1 {
            assert!(!t.on_call(true));
            if t.on_call(false) {
                fired.push(call);
            }
        }
        assert_eq!(fired, vec![TUNE_AFTER_CALLS]);
        let mut s = Tuning::Settled;
        assert!(!s.on_call(false));
    }

    #[test]
    fn the_budget_runs_out() {
        let mut b = Budget::default();
        assert!(b.allows());
        b.spend(-5.0);
        b.spend(TUNE_BUDGET_MS - 1.0);
        assert!(b.allows());
        b.spend(1.0);
        assert!(!b.allows());
    }

    #[test]
    fn the_fastest_candidate_wins_and_ties_keep_the_heuristic_order() {
        assert_eq!(fastest(&[Some(2.0), Some(1.5), Some(1.7)]), Some(1));
        assert_eq!(fastest(&[Some(1.0), Some(1.0)]), Some(0));
        assert_eq!(fastest(&[None, Some(3.0), None]), Some(1));
        assert_eq!(fastest(&[Some(f32::NAN), Some(3.0)]), Some(1));
        assert_eq!(fastest(&[None, None]), None);
        assert_eq!(fastest(&[]), None);
    }

    #[test]
    fn file_names_carry_device_capability_and_library_version() {
        assert_eq!(
            file_name("NVIDIA H200", (9, 0), 130_001),
            "gemm-tune-NVIDIA_H200-sm_90-cublaslt130001.txt"
        );
        assert_eq!(
            file_name("../../etc/x y", (8, 6), 1),
            "gemm-tune-______etc_x_y-sm_86-cublaslt1.txt"
        );
        assert!(file_name(&"a".repeat(1000), (9, 0), 1).len() < 120);
    }

    #[test]
    fn lines_round_trip_and_bad_lines_are_rejected() {
        let k = key(28672, 32768, 4096, false, false);
        let line = format_line(&k, 6);
        assert_eq!(line, "28672 32768 4096 0 0 8 8 4 6\n");
        assert_eq!(parse_line(line.trim_end()), Some((k, 6)));
        let k2 = key(4096, 2000, 14336, true, true);
        assert_eq!(parse_line(&format_line(&k2, 0)), Some((k2, 0)));
        for bad in [
            "",
            "1 2 3",
            "28672 32768 4096 0 0 8 8 4 8", // index beyond the candidates
            "28672 32768 4096 2 0 8 8 4 1", // c_f32 not 0/1
            "28672 32768 4096 0 0 9 8 4 1", // alignment beyond 256 bytes
            "0 32768 4096 0 0 8 8 4 1",     // empty dimension
            "28672 32768 4096 0 0 8 8 4 1 7", // extra field
            "28672 -1 4096 0 0 8 8 4 1",
            "28672 99999999999 4096 0 0 8 8 4 1",
            "a b c d e f g h i",
        ] {
            assert_eq!(parse_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_store_persists_choices_and_skips_garbage() {
        let dir = std::env::temp_dir().join(format!("switchyard-tune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nested").join("tune.txt");
        let (a, b) = (
            key(6144, 32768, 4096, true, false),
            key(4096, 2000, 4096, true, true),
        );
        {
            let mut s = TuneStore::open(Some(path.clone()));
            assert_eq!(s.len(), 0);
            s.record(a, 5);
            s.record(b, 1);
            s.record(b, MAX_CANDIDATES); // out of range: ignored
            assert_eq!(s.get(&b), Some(1));
        }
        // Garbage and a later choice for the same shape.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"not a line\n\xff\xfe\n").unwrap();
        f.write_all(format_line(&a, 2).as_bytes()).unwrap();
        drop(f);
        let s = TuneStore::open(Some(path.clone()));
        assert_eq!(s.len(), 2);
        assert_eq!(s.get(&a), Some(2));
        assert_eq!(s.get(&b), Some(1));
        // Memory-only and unreadable stores work too.
        let mut m = TuneStore::open(None);
        m.record(a, 3);
        assert_eq!(m.get(&a), Some(3));
        assert_eq!(TuneStore::open(Some(dir.join("missing"))).len(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
