//! What `lora.adapter_dirs` hold now, for the model list: the names of the adapters a request
//! could name and be served from a directory (vLLM's filesystem resolver), found without
//! loading or registering anything.
//!
//! The test is the LoRA manager's own ([`holds_adapter`], [`check_name`]): an entry of a
//! directory is an adapter when its name is one a registration could take and
//! `<dir>/<name>/adapter_config.json` is a regular file. Nothing below `<name>/` is looked at.
//!
//! Bounded. A scan reads at most [`MAX_DIR_ENTRIES`] entries of each directory (whatever they
//! are, unreadable ones included), in the order the file system gives them, and warns once per
//! directory (for the process's life) when a directory holds more: the adapters beyond the
//! bound are served on demand all the same, but not listed. Directories or entries that cannot
//! be read are skipped (logged at debug). So a scan stats at most 16 × 4,096 paths and keeps at
//! most as many names of at most 128 bytes.
//!
//! Off the executor. Scans are blocking file-system work, so they run on a thread of their own
//! (a one-thread `SyncArbiter`, like the manager's, but apart from it: a `/v1/models` never
//! waits behind an adapter's load), and a scan's result is reused for [`FOUND_TTL`], so clients
//! polling the model list do not rescan the directories per request.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, Handler, Message, SyncContext};

use super::lora::LoraError;

/// Most entries of one directory a scan reads.
pub const MAX_DIR_ENTRIES: usize = 4096;

/// How long a scan's result is reused.
pub const FOUND_TTL: Duration = Duration::from_secs(1);

/// Whether `dir` holds a PEFT adapter: its `adapter_config.json` is a regular file (a link is
/// followed; a FIFO, a device or a directory is no adapter's). The manager's test too.
pub(crate) fn holds_adapter(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file()
}

/// The directory of the adapter `name` in the first of `dirs` that holds one (`<dir>/<name>/`
/// with an `adapter_config.json`, [`holds_adapter`]); `None` for a name no registration could
/// take (one path segment, never `.` or `..`: checked before it is joined to a directory) or
/// that no directory holds. Nothing is read but the directories' entries.
pub(crate) fn locate(dirs: &[PathBuf], name: &str, base_name: &str) -> Option<PathBuf> {
    check_name(name, base_name).ok()?;
    dirs.iter()
        .map(|dir| dir.join(name))
        .find(|path| holds_adapter(path))
}

/// Whether a registration may take `name`: the configuration's check (one path segment, never
/// `.` or `..`), and not the base model's name.
pub(crate) fn check_name(name: &str, base_name: &str) -> Result<(), LoraError> {
    switchyard_config::check_adapter_name(name).map_err(LoraError::BadName)?;
    if name == base_name {
        return Err(LoraError::BadName("that is the base model's name".into()));
    }
    Ok(())
}

/// The scan of the directories, with what it remembers between scans.
pub(crate) struct DirectoryScan {
    /// The directories, in the order they are searched.
    dirs: Vec<PathBuf>,
    /// The base model's served name (no adapter's).
    base_name: String,
    /// Most entries read per directory.
    max_entries: usize,
    /// Per directory: whether it was already reported holding more than `max_entries`.
    warned: Vec<bool>,
}

impl DirectoryScan {
    /// A scan of `dirs` that reads at most `max_entries` entries of each.
    pub(crate) fn new(dirs: Vec<PathBuf>, base_name: String, max_entries: usize) -> Self {
        let warned = vec![false; dirs.len()];
        DirectoryScan {
            dirs,
            base_name,
            max_entries,
            warned,
        }
    }

    /// The names of the adapters the directories hold now, sorted, each once.
    pub(crate) fn scan(&mut self) -> Vec<String> {
        let mut found = BTreeSet::new();
        for (i, dir) in self.dirs.iter().enumerate() {
            let entries = match std::fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) => {
                    tracing::debug!(dir = %dir.display(), error = %e,
                        "lora.adapter_dirs: directory not listed");
                    continue;
                }
            };
            for (read, entry) in entries.enumerate() {
                if read == self.max_entries {
                    if !self.warned[i] {
                        self.warned[i] = true;
                        tracing::warn!(
                            dir = %dir.display(),
                            max = self.max_entries,
                            "lora.adapter_dirs: the directory holds more entries than are \
                             listed; adapters beyond them are served on demand but not listed \
                             in /v1/models (said once)"
                        );
                    }
                    break;
                }
                let entry = match entry {
                    Ok(entry) => entry,
                    Err(e) => {
                        tracing::debug!(dir = %dir.display(), error = %e,
                            "lora.adapter_dirs: entry not read");
                        continue;
                    }
                };
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if found.contains(name) || check_name(name, &self.base_name).is_err() {
                    continue;
                }
                if holds_adapter(&entry.path()) {
                    found.insert(name.to_owned());
                }
            }
        }
        found.into_iter().collect()
    }
}

/// The actor that scans the directories on its own thread and keeps the last result for
/// [`FOUND_TTL`].
pub struct DirectoryScanner {
    /// The scan.
    scan: DirectoryScan,
    /// How long a result is reused ([`FOUND_TTL`]).
    ttl: Duration,
    /// The last result and when it was made.
    last: Option<(Instant, Arc<Vec<String>>)>,
}

impl DirectoryScanner {
    /// A scanner of `dirs` (see [`MAX_DIR_ENTRIES`] and [`FOUND_TTL`]).
    pub(crate) fn new(dirs: Vec<PathBuf>, base_name: String) -> Self {
        DirectoryScanner {
            scan: DirectoryScan::new(dirs, base_name, MAX_DIR_ENTRIES),
            ttl: FOUND_TTL,
            last: None,
        }
    }
}

impl Actor for DirectoryScanner {
    type Context = SyncContext<Self>;
}

/// The names of the adapters the directories hold (a scan at most [`FOUND_TTL`] old).
#[derive(Message)]
#[rtype(result = "Arc<Vec<String>>")]
pub(crate) struct ListFound;

impl Handler<ListFound> for DirectoryScanner {
    type Result = Arc<Vec<String>>;
    fn handle(&mut self, _: ListFound, _: &mut Self::Context) -> Self::Result {
        if let Some((at, names)) = &self.last {
            if at.elapsed() < self.ttl {
                return names.clone();
            }
        }
        let names = Arc::new(self.scan.scan());
        self.last = Some((Instant::now(), names.clone()));
        names
    }
}

/// Whether a request may name the adapter `name` of the directories: one of them holds it now
/// ([`locate`]; a stat per directory, nothing read or loaded).
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct Holds(pub String);

impl Handler<Holds> for DirectoryScanner {
    type Result = bool;
    fn handle(&mut self, msg: Holds, _: &mut Self::Context) -> bool {
        locate(&self.scan.dirs, &msg.0, &self.scan.base_name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("sy-lora-scan-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        /// `<root>/<name>/adapter_config.json` as a regular file (the scan never reads it).
        fn adapter(&self, name: &str) {
            let dir = self.0.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("adapter_config.json"), "{}").unwrap();
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn scan(dirs: &[&Path], max_entries: usize) -> DirectoryScan {
        let dirs = dirs.iter().map(|d| d.to_path_buf()).collect();
        DirectoryScan::new(dirs, "base".into(), max_entries)
    }

    #[test]
    fn only_entries_a_request_could_be_served_from_are_listed() {
        let first = Scratch::new("first");
        let second = Scratch::new("second");
        for name in ["good", "both", ".hidden", "a:b@c+d", "base", "a b", "a%20b"] {
            first.adapter(name);
        }
        second.adapter("both");
        second.adapter("later");
        // A directory without adapter_config.json, a file, a directory named
        // adapter_config.json, a FIFO, a link to a device, and a link to an adapter (followed,
        // as the manager follows it).
        std::fs::create_dir_all(first.0.join("empty")).unwrap();
        std::fs::write(first.0.join("file"), "{}").unwrap();
        std::fs::create_dir_all(first.0.join("subdir/adapter_config.json")).unwrap();
        std::fs::create_dir_all(first.0.join("fifo")).unwrap();
        let fifo = first.0.join("fifo/adapter_config.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        std::fs::create_dir_all(first.0.join("device")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", first.0.join("device/adapter_config.json"))
            .unwrap();
        std::os::unix::fs::symlink(first.0.join("good"), first.0.join("linked")).unwrap();
        let missing = Path::new("/nonexistent/adapters");
        let names = scan(&[missing, &first.0, &second.0], MAX_DIR_ENTRIES).scan();
        // Sorted, each once; `base` is the base model's name, `a b` and `a%20b` no
        // registration's; `.hidden` and `a:b@c+d` are names a registration may take.
        assert_eq!(
            names,
            [".hidden", "a:b@c+d", "both", "good", "later", "linked"]
        );
        // The manager's test says the same of each.
        for name in ["empty", "file", "subdir", "fifo", "device"] {
            assert!(!holds_adapter(&first.0.join(name)), "{name}");
        }
        assert!(holds_adapter(&first.0.join("linked")));
    }

    #[test]
    fn a_scan_reads_at_most_max_entries_of_each_directory() {
        let big = Scratch::new("big");
        let small = Scratch::new("small");
        for i in 0..10 {
            big.adapter(&format!("a{i}"));
        }
        small.adapter("s1");
        small.adapter("s2");
        let mut s = scan(&[&big.0, &small.0], 4);
        let names = s.scan();
        // Four of the big directory's (which four is the file system's order), both of the
        // small one's.
        assert_eq!(names.len(), 6, "{names:?}");
        assert_eq!(names.iter().filter(|n| n.starts_with('a')).count(), 4);
        assert!(names.contains(&"s1".to_string()) && names.contains(&"s2".to_string()));
        assert_eq!(s.warned, [true, false]);
        // Entries that are no adapter's count too: the bound is on what is read.
        let junk = Scratch::new("junk");
        for i in 0..5 {
            std::fs::write(junk.0.join(format!("f{i}")), "").unwrap();
        }
        junk.adapter("z");
        let names = scan(&[&junk.0], 3).scan();
        assert!(names.len() <= 1, "{names:?}");
        assert_eq!(scan(&[&junk.0], 6).scan(), ["z"]);
    }

    /// A scan's result is reused while it is fresh, and only then.
    #[actix::test]
    async fn the_scanner_reuses_a_fresh_scan() {
        let root = Scratch::new("ttl");
        root.adapter("x");
        let start = |ttl: Duration| {
            let dirs = vec![root.0.clone()];
            actix::SyncArbiter::start(1, move || DirectoryScanner {
                ttl,
                ..DirectoryScanner::new(dirs.clone(), "base".into())
            })
        };
        let (fresh, stale) = (start(Duration::from_secs(3600)), start(Duration::ZERO));
        assert_eq!(*fresh.send(ListFound).await.unwrap(), ["x"]);
        assert_eq!(*stale.send(ListFound).await.unwrap(), ["x"]);
        root.adapter("y");
        assert_eq!(*fresh.send(ListFound).await.unwrap(), ["x"], "reused");
        assert_eq!(
            *stale.send(ListFound).await.unwrap(),
            ["x", "y"],
            "scanned again"
        );
    }

    /// Removing an adapter's directory takes it off the next scan.
    #[test]
    fn a_scan_says_what_the_directories_hold_now() {
        let root = Scratch::new("now");
        let mut s = scan(&[&root.0], MAX_DIR_ENTRIES);
        assert!(s.scan().is_empty());
        root.adapter("x");
        assert_eq!(s.scan(), ["x"]);
        std::fs::remove_file(root.0.join("x/adapter_config.json")).unwrap();
        assert!(s.scan().is_empty());
    }
}
