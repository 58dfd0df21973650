//! The store's journal on disk (`server.responses.path`): stored responses survive a restart.
//!
//! One directory holds `responses.jsonl`, an append-only log of JSON lines, and `lock`, held
//! with `flock` by the server that owns the directory (a second server on it is refused at
//! start). The log opens with a header line naming its format and version, then one record a
//! line:
//!
//! - `{"op":"put","tenant":..,"id":..,"at_ms":..,"turn":K,"turns":[..],"response":{..}}`: a
//!   stored response, its conversation's last turn `K`, and the turns of its conversation not
//!   yet in the file (each `{"id","parent","input","output"}`, oldest first). A turn is
//!   written once per file however many responses continue it, so a long conversation costs
//!   its new items per turn, not its whole history.
//! - `{"op":"delete","tenant":..,"id":..}`: a response deleted, evicted or expired.
//! - `{"op":"touch","tenant":..,"id":..}` (version 2): a response read (`GET`, or continued by
//!   `previous_response_id`), so it is the most recently used. Not written for a read of the
//!   response already the most recently used (a client polling one response writes nothing
//!   more), nor synced on its own (losing one loses no response, only its recency).
//!
//! Writes are off the HTTP workers: the store queues each change, under its lock, so the log's
//! order is the store's; one thread ([`writer`]) appends them, one `write` a record, and
//! `fdatasync`s whenever the queue is empty (group commit). A crash of the process loses
//! nothing written; a power loss, at most the records since the last sync. A failed write
//! (disk full) is logged at ERROR and counted in `responses_journal_errors_total`; the client's
//! response is already sent, and the next record starts on a fresh line.
//!
//! The queue is bounded, so a slow disk cannot grow the server's memory: at most
//! [`QUEUE_RECORDS`] records, counting at most the store's byte bound (a put counts its
//! response's bytes in the store: its object and conversation, which it keeps alive). The
//! request path never waits on it: a record that finds it full is dropped, counted in
//! `responses_journal_errors_total` and WARNed at most once per [`DROP_WARN_INTERVAL`]. A
//! dropped put or delete leaves the log saying something the store does not (a deleted
//! response, or an older version of a replaced one, would come back at a restart), so it marks
//! the log lost: once the writer has caught up, it takes the store's lock (under which every
//! record is queued), discards what is still queued (sent before, so in the store already) and
//! rewrites the log from the store's live responses, before it answers a sync. Until then a
//! crash loses what the queue held, as it would with a queue of any size; a graceful stop
//! waits for the rewrite. A dropped touch costs only its recency and marks nothing.
//!
//! The log is compacted (rewritten from the store's live responses, least recently used first,
//! into a temporary file, synced, renamed over the log) at start and whenever it grows past
//! twice the bytes the store holds plus [`COMPACT_FLOOR`], so dead records never outweigh live
//! ones for long, and a restart reads at most about twice the store's byte bound. A reload
//! inserts the responses in the file's order and applies its touches, so the recency order
//! survives a restart: compacted, or as puts and touches since.
//!
//! The files are untrusted input. A line longer than the store's byte bound (plus
//! [`RECORD_ENVELOPE`]) is skipped with a WARN without being held, as is a line that is not a
//! record (a torn last line after a crash among them) or a put whose turns are missing. A log
//! larger than [`MAX_READ_FACTOR`] times the byte bound (plus [`COMPACT_FLOOR`]) refuses the
//! start, as a header of another format or version does: this server never writes one (it
//! compacts at twice the live bytes), and reading only its start would lose its latest
//! records, deletions included, so that responses deleted since would come back. Loading replays the records into the store,
//! which applies its bounds as it goes (the oldest leave first) and drops what is past
//! `max_age`, keeping each response's tenant.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{key, Inner, Key, ResponseStore, Turn};
use crate::metrics::RESPONSES_EVICTED;
use crate::metrics::RESPONSES_JOURNAL_ERRORS;

mod writer;
use writer::{Queued, Writer};

/// The log's file name in the directory.
pub const LOG_FILE: &str = "responses.jsonl";
/// The lock file's name in the directory.
pub const LOCK_FILE: &str = "lock";

/// The file a compaction writes before renaming it over the log.
pub const TMP_FILE: &str = "responses.jsonl.tmp";
/// The header's `format`.
const FORMAT: &str = "switchyard-responses";
/// The header's `version` this build writes; it reads this one and version 1 (which has no
/// `touch` records).
pub const VERSION: u64 = 2;
/// Longest header line read.
const MAX_HEADER: usize = 4096;
/// Bytes a record may take beyond the store's byte bound (its keys and numbers).
pub const RECORD_ENVELOPE: usize = 64 << 10;
/// The log is compacted once it is larger than twice the live bytes and this.
pub const COMPACT_FLOOR: u64 = 1 << 20;
/// Largest turn id read: a file's ids above it are refused, so that the ids this process gives
/// after the largest read can never overflow.
pub const MAX_TURN_ID: u64 = 1 << 48;
/// A start reads at most this many times the byte bound of the log.
pub const MAX_READ_FACTOR: u64 = 4;
/// Most records queued for the writer. The request path never waits on the disk: a record
/// that finds the queue full (or the queued records holding the store's byte bound already)
/// is dropped, counted in `responses_journal_errors_total`, and the writer rewrites the log
/// from the store once it has caught up (see [`writer`]).
pub const QUEUE_RECORDS: usize = 4096;
/// At most one WARN this often about dropped records (each is counted).
pub const DROP_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Why the journal could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A file operation failed.
    #[error("server.responses.path `{path}`: {what}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The path is not a directory.
    #[error("server.responses.path `{0}` is not a directory")]
    NotADirectory(PathBuf),
    /// The path, or a directory above it, is a symbolic link whose target does not exist
    /// (creating the directory there fails with only "File exists").
    #[error("server.responses.path: {}", dangling_text(.link, .target))]
    DanglingLink {
        /// The link.
        link: PathBuf,
        /// What it points to.
        target: PathBuf,
    },
    /// The lock file, the log or the log's temporary file is there but not a regular file (a
    /// FIFO would block the start forever, a directory cannot be written).
    #[error(
        "server.responses.path: `{0}` is not a regular file: the journal keeps its lock and \
         log there as plain files; move it away"
    )]
    NotAFile(PathBuf),
    /// Another process holds the directory's lock.
    #[error(
        "server.responses.path `{0}` is in use by another server (its lock file is held): \
         two servers cannot share one store of responses"
    )]
    Locked(PathBuf),
    /// The log is larger than a store within the byte bound writes (the bound was lowered,
    /// or the file is not this server's).
    #[error(
        "server.responses.path `{path}`: `{LOG_FILE}` holds {bytes} bytes, more than the \
         {limit} a store within server.responses.max_stored_mb writes ({MAX_READ_FACTOR} times \
         the bound and 1 MiB; was the bound lowered?): reading only its start would lose its \
         latest changes and bring back responses deleted since. Raise \
         server.responses.max_stored_mb, or move the log away"
    )]
    TooLarge {
        /// The log file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The most read.
        limit: u64,
    },
    /// The log is of another format or version.
    #[error(
        "server.responses.path `{path}`: `{LOG_FILE}` is {found}, not a log this server reads \
         (format {FORMAT} version 1 to {VERSION}); move it away or point the path elsewhere"
    )]
    UnknownVersion {
        /// The log file.
        path: PathBuf,
        /// What its header says.
        found: String,
    },
}

fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> JournalError {
    let path = path.to_owned();
    move |source| JournalError::Io { path, what, source }
}

/// Checks that `dir` is a directory, or creates it (`config check` and the start).
pub fn ensure_directory(dir: &Path) -> Result<(), JournalError> {
    if dir.exists() && !dir.is_dir() {
        return Err(JournalError::NotADirectory(dir.to_owned()));
    }
    if let Some((link, target)) = dangling_link(dir) {
        return Err(JournalError::DanglingLink { link, target });
    }
    std::fs::create_dir_all(dir).map_err(io(dir, "cannot create the directory"))
}

/// The first of `dir` and the directories above it that is a symbolic link to a missing
/// target, with its target, found before an existing directory: `create_dir_all` would answer
/// only "File exists" there.
fn dangling_link(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let mut at = Some(dir);
    while let Some(p) = at {
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if std::fs::symlink_metadata(p).is_ok_and(|m| m.is_symlink()) {
                    let target = std::fs::read_link(p).unwrap_or_default();
                    return Some((p.to_owned(), target));
                }
                at = p.parent();
            }
            _ => return None,
        }
    }
    None
}

/// How a [`dangling_link`] is told.
fn dangling_text(link: &Path, target: &Path) -> String {
    format!(
        "`{}` is a symbolic link to `{}`, which does not exist; create the target directory \
         or point the path elsewhere",
        link.display(),
        target.display()
    )
}

/// Refuses `path` when it is there but is not a regular file (or a link to one): opening a
/// FIFO blocks until a writer comes, and a device or directory is not the journal's.
pub(super) fn refuse_special(path: &Path) -> Result<(), JournalError> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(JournalError::NotAFile(path.to_owned())),
        _ => Ok(()),
    }
}

/// Longest `server.responses.path`, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;

/// Why `dir` cannot hold the journal, without creating anything (`config check`): it must be
/// a directory, or be creatable in the nearest directory above it that exists, which must not
/// be read-only; an existing directory's lock, log and compaction file must be regular files or
/// absent.
pub fn check_directory(dir: &Path) -> Result<(), String> {
    if dir.as_os_str().is_empty() || dir.as_os_str().len() > MAX_PATH_BYTES {
        return Err(format!("a path of 1-{MAX_PATH_BYTES} bytes is required"));
    }
    if let Some((link, target)) = dangling_link(dir) {
        return Err(dangling_text(&link, &target));
    }
    let mut at = Some(dir);
    while let Some(p) = at {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => {
                if m.permissions().readonly() {
                    return Err(format!("`{}` is read-only", p.display()));
                }
                if p != dir {
                    return Ok(());
                }
                // The journal's own files, where the directory is there already (as the start
                // checks them: a FIFO would block it).
                return [LOCK_FILE, LOG_FILE, TMP_FILE]
                    .iter()
                    .try_for_each(|name| refuse_special(&p.join(name)))
                    .map_err(|e| match e {
                        JournalError::NotAFile(path) => {
                            format!("`{}` is not a regular file", path.display())
                        }
                        e => e.to_string(),
                    });
            }
            Ok(_) => return Err(format!("`{}` is not a directory", p.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => at = p.parent(),
            Err(e) => return Err(format!("`{}`: {e}", p.display())),
        }
        if at.is_some_and(|p| p.as_os_str().is_empty()) {
            // A relative path whose first part is missing: created in the working directory.
            at = Some(Path::new("."));
        }
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    version: u64,
}

#[derive(Serialize, Deserialize)]
struct TurnRecord {
    id: u64,
    parent: Option<u64>,
    input: Vec<Value>,
    output: Vec<Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
enum Record {
    Put {
        tenant: String,
        id: String,
        at_ms: u64,
        turn: u64,
        turns: Vec<TurnRecord>,
        response: Value,
    },
    Delete {
        tenant: String,
        id: String,
    },
    /// The response was read: it is the most recently used.
    Touch {
        tenant: String,
        id: String,
    },
}

/// A stored response, as the writer writes it.
pub(super) struct PutOp {
    pub(super) tenant: String,
    pub(super) id: String,
    pub(super) at_ms: u64,
    pub(super) response: Value,
    pub(super) turn: Arc<Turn>,
}

/// What the store sends its writer.
pub(super) enum Op {
    Put(PutOp),
    Delete {
        tenant: String,
        id: String,
    },
    /// The response was read (recency only: dropped without harm).
    Touch {
        tenant: String,
        id: String,
    },
    /// Rewrite the log as these responses, least recently used first.
    Compact(Vec<PutOp>),
    /// Answer once everything before is written and synced.
    Sync(mpsc::Sender<()>),
    /// Stall the writer, once it says so on `entered`, until `release` sends or drops (a slow
    /// disk, for tests).
    #[cfg(test)]
    Hold {
        entered: mpsc::Sender<()>,
        release: mpsc::Receiver<()>,
    },
}

/// What the store's end and the writer share.
#[derive(Default)]
pub(super) struct Shared {
    /// The log's size now, as the writer last saw it.
    file_bytes: AtomicU64,
    /// A compaction was asked for and is not done.
    compacting: AtomicBool,
    /// A put or delete was dropped: the log no longer says what the store holds until the
    /// writer rewrites it from the store.
    lost: AtomicBool,
    /// Bytes the queued records count (a put: its response's bytes in the store).
    queued_bytes: AtomicUsize,
}

/// The store's end of the journal: the bounded queue to its writer. Dropped, it lets the writer
/// finish what was sent and waits for it (the lock goes with it).
pub(super) struct Journal {
    tx: mpsc::SyncSender<Queued>,
    writer: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
    /// Most bytes the queued records may count: the store's byte bound, so that the queue keeps
    /// at most one more store's worth alive.
    max_queued_bytes: usize,
    /// Records dropped since the last WARN, and when that was.
    dropped: parking_lot::Mutex<(u64, Option<Instant>)>,
}

impl Drop for Journal {
    fn drop(&mut self) {
        let (closed, _) = mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.tx, closed));
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl Journal {
    /// Queues `op`, counting `weight` bytes, without waiting: dropped when the queue is full
    /// (a put or delete marks the log for a rewrite from the store; a touch is only recency).
    pub(super) fn offer(&self, op: Op, weight: usize) {
        let recency_only = matches!(op, Op::Touch { .. });
        let queued = self.shared.queued_bytes.fetch_add(weight, Ordering::AcqRel);
        // One record is always let in, whatever it weighs (the store holds it within its bound).
        let sent = if queued > 0 && queued.saturating_add(weight) > self.max_queued_bytes {
            false
        } else {
            match self.tx.try_send((op, weight)) {
                Ok(()) => true,
                Err(mpsc::TrySendError::Full(_)) => false,
                Err(mpsc::TrySendError::Disconnected(_)) => {
                    tracing::error!(
                        "the responses journal's writer is gone: the change is not saved"
                    );
                    metrics::counter!(RESPONSES_JOURNAL_ERRORS).increment(1);
                    return;
                }
            }
        };
        if !sent {
            self.shared.queued_bytes.fetch_sub(weight, Ordering::AcqRel);
            self.dropped(recency_only);
        }
    }

    /// Counts a dropped record, marks the log for a rewrite unless it was `recency_only`, and
    /// WARNs at most once per [`DROP_WARN_INTERVAL`].
    fn dropped(&self, recency_only: bool) {
        if !recency_only {
            self.shared.lost.store(true, Ordering::Release);
        }
        metrics::counter!(RESPONSES_JOURNAL_ERRORS).increment(1);
        let mut dropped = self.dropped.lock();
        dropped.0 += 1;
        let now = Instant::now();
        if dropped
            .1
            .is_none_or(|at| now.duration_since(at) >= DROP_WARN_INTERVAL)
        {
            tracing::warn!(
                dropped = dropped.0,
                queue = QUEUE_RECORDS,
                queued_bytes = self.shared.queued_bytes.load(Ordering::Relaxed),
                "the responses journal's writer is behind (a slow disk): changes to stored \
                 responses are dropped from its queue rather than waiting; its log is \
                 rewritten from the store once it catches up"
            );
            *dropped = (0, Some(now));
        }
    }

    /// Queues a compaction to `snapshot` if there is room (it is asked for again later if not).
    pub(super) fn compact(&self, snapshot: Vec<PutOp>) {
        if self.tx.try_send((Op::Compact(snapshot), 0)).is_err() {
            self.shared.compacting.store(false, Ordering::Release);
        }
    }

    /// Whether the log outweighs `live` bytes enough to compact it, marking the compaction
    /// asked for (the caller sends it).
    pub(super) fn wants_compaction(&self, live: usize) -> bool {
        let file = self.shared.file_bytes.load(Ordering::Relaxed);
        file > (live as u64)
            .saturating_mul(2)
            .saturating_add(COMPACT_FLOOR)
            && !self.shared.compacting.swap(true, Ordering::AcqRel)
    }

    /// Blocks until every change sent so far is written and synced (off the request path: it
    /// waits for room in the queue).
    pub(super) fn sync(&self) {
        let (tx, rx) = mpsc::channel();
        if self.tx.send((Op::Sync(tx), 0)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Stalls the writer until `release` sends or drops; returns once it is stalled, its queue
    /// empty.
    #[cfg(test)]
    fn hold(&self, release: mpsc::Receiver<()>) {
        let (entered, stalled) = mpsc::channel();
        let _ = self.tx.send((Op::Hold { entered, release }, 0));
        let _ = stalled.recv();
    }
}

/// Milliseconds since the Unix epoch.
pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Opens the journal in `dir` for `store` (just made, empty): takes the lock, replays the log
/// into the store, compacts it and starts the writer.
pub(super) fn open(dir: &Path, store: &mut ResponseStore) -> Result<(), JournalError> {
    open_with(dir, store, QUEUE_RECORDS)
}

/// [`open`], with a queue of `queue` records.
fn open_with(dir: &Path, store: &mut ResponseStore, queue: usize) -> Result<(), JournalError> {
    ensure_directory(dir)?;
    let lock_path = dir.join(LOCK_FILE);
    let log = dir.join(LOG_FILE);
    for path in [&lock_path, &log, &dir.join(TMP_FILE)] {
        refuse_special(path)?;
    }
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path, "cannot open the lock file"))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(JournalError::Locked(dir.to_owned())),
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(io(&lock_path, "cannot lock the lock file")(e))
        }
    }
    let next_turn = load(&log, store)?;
    let snapshot = store.snapshot();
    let shared = Arc::new(Shared::default());
    let mut writer = Writer::new(
        dir.to_owned(),
        lock,
        next_turn,
        Arc::clone(&shared),
        Arc::downgrade(&store.inner),
    );
    writer
        .compact(snapshot)
        .map_err(io(&log, "cannot rewrite the log"))?;
    let (tx, rx) = mpsc::sync_channel(queue);
    let thread = std::thread::Builder::new()
        .name("responses-journal".into())
        .spawn(move || writer.run(rx))
        .map_err(io(dir, "cannot start the journal's writer"))?;
    store.journal = Some(Journal {
        tx,
        writer: Some(thread),
        shared,
        max_queued_bytes: store.limits.max_bytes,
        dropped: parking_lot::Mutex::new((0, None)),
    });
    Ok(())
}

/// Reads one line of at most `max` bytes (its newline included) into `buf`: `Ok(None)` at the
/// end, `Ok(Some(true))` for a whole line, `Ok(Some(false))` for one cut by the end of the file
/// (a torn last line), and a longer line is skipped to its end, unread, as `Err(len)`.
fn read_line(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Result<Option<bool>, u64>> {
    buf.clear();
    let n = reader.by_ref().take(max as u64).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(Ok(None));
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(Ok(Some(true)));
    }
    if n < max {
        return Ok(Ok(Some(false)));
    }
    // Longer than `max`: skip to the newline without holding it.
    let mut len = n as u64;
    loop {
        let chunk = reader.fill_buf()?;
        if chunk.is_empty() {
            break;
        }
        match chunk.iter().position(|&b| b == b'\n') {
            Some(at) => {
                reader.consume(at + 1);
                len += at as u64 + 1;
                break;
            }
            None => {
                let all = chunk.len();
                reader.consume(all);
                len += all as u64;
            }
        }
    }
    buf.clear();
    Ok(Err(len))
}

/// Replays the log at `path` (if any) into `store`; the next free turn id.
fn load(path: &Path, store: &ResponseStore) -> Result<u64, JournalError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io(path, "cannot open the log")(e)),
    };
    let max_bytes = store.limits.max_bytes;
    let budget = (max_bytes as u64)
        .saturating_mul(MAX_READ_FACTOR)
        .saturating_add(COMPACT_FLOOR);
    let bytes = file
        .metadata()
        .map_err(io(path, "cannot read the log"))?
        .len();
    // A store that keeps nothing loads nothing: its start's compaction empties the log.
    if bytes > budget && store.limits.enabled() {
        return Err(JournalError::TooLarge {
            path: path.to_owned(),
            bytes,
            limit: budget,
        });
    }
    let mut reader = BufReader::new(file.take(budget));
    let mut buf = Vec::new();
    let read = |r: &mut BufReader<_>, b: &mut Vec<u8>, max| {
        read_line(r, b, max).map_err(io(path, "cannot read the log"))
    };
    match read(&mut reader, &mut buf, MAX_HEADER)? {
        Ok(None) => return Ok(0),
        Ok(Some(_)) => match serde_json::from_slice::<Header>(&buf) {
            Ok(h) if h.format == FORMAT && (1..=VERSION).contains(&h.version) => {}
            Ok(h) => {
                return Err(JournalError::UnknownVersion {
                    path: path.to_owned(),
                    found: format!("format {} version {}", h.format, h.version),
                })
            }
            Err(_) => {
                return Err(JournalError::UnknownVersion {
                    path: path.to_owned(),
                    found: "a file without a header".into(),
                })
            }
        },
        Err(_) => {
            return Err(JournalError::UnknownVersion {
                path: path.to_owned(),
                found: "a file without a header".into(),
            })
        }
    }
    let max_line = max_bytes.saturating_add(RECORD_ENVELOPE);
    let mut turns: HashMap<u64, Arc<Turn>> = HashMap::new();
    let mut next_turn = 0u64;
    let mut line = 1u64;
    let (now, now_ms) = (Instant::now(), unix_ms());
    let mut bytes_read = 0u64;
    loop {
        line += 1;
        let whole = match read(&mut reader, &mut buf, max_line)? {
            Ok(None) => break,
            Ok(Some(whole)) => whole,
            Err(len) => {
                tracing::warn!(
                    path = %path.display(),
                    line,
                    bytes = len,
                    max = max_line,
                    "a stored response's record is larger than server.responses.max_stored_mb \
                     allows: skipped"
                );
                bytes_read += len;
                continue;
            }
        };
        bytes_read += buf.len() as u64 + 1;
        if !whole {
            tracing::warn!(
                path = %path.display(),
                line,
                "the log's last line is cut short (the server stopped while writing it): \
                 skipped"
            );
            break;
        }
        if buf.is_empty() {
            continue;
        }
        let record: Record = match serde_json::from_slice(&buf) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(path = %path.display(), line, error = %e, "not a record of the log: skipped");
                continue;
            }
        };
        match record {
            Record::Delete { tenant, id } => {
                store.remove_loaded(&tenant, &id);
            }
            Record::Touch { tenant, id } => {
                store.inner.lock().touch(&key(&tenant, &id));
            }
            Record::Put {
                tenant,
                id,
                at_ms,
                turn,
                turns: new,
                response,
            } => {
                let mut missing = None;
                if let Some(bad) = new.iter().map(|t| t.id).find(|&id| id > MAX_TURN_ID) {
                    tracing::warn!(
                        path = %path.display(),
                        line,
                        turn = bad,
                        "a turn id above {MAX_TURN_ID}: the stored response is skipped"
                    );
                    continue;
                }
                for t in new {
                    next_turn = next_turn.max(t.id + 1);
                    if turns.contains_key(&t.id) {
                        continue;
                    }
                    let parent = match t.parent {
                        None => None,
                        Some(p) => match turns.get(&p) {
                            Some(p) => Some(Arc::clone(p)),
                            None => {
                                missing = Some(p);
                                break;
                            }
                        },
                    };
                    let made = Turn::new(t.input, t.output, parent);
                    let _ = made.journal_id.set(t.id);
                    turns.insert(t.id, Arc::new(made));
                }
                let found = turns.get(&turn).filter(|_| missing.is_none());
                let Some(found) = found else {
                    tracing::warn!(
                        path = %path.display(),
                        line,
                        turn = missing.unwrap_or(turn),
                        "a stored response's conversation is not in the log: skipped"
                    );
                    continue;
                };
                let age = Duration::from_millis(now_ms.saturating_sub(at_ms));
                if store.limits.max_age.is_some_and(|max| age > max) {
                    store.remove_loaded(&tenant, &id);
                    continue;
                }
                // Younger than the process's clock can tell (its `Instant` starts near boot):
                // counted from now.
                let at = now.checked_sub(age).unwrap_or(now);
                store.insert_loaded(&id, &tenant, response, Arc::clone(found), at, at_ms);
            }
        }
    }
    if bytes_read >= budget {
        tracing::warn!(
            path = %path.display(),
            read = bytes_read,
            "the log is larger than a store within server.responses.max_stored_mb writes: \
             the rest is skipped"
        );
    }
    store.expire_all(now);
    tracing::info!(
        path = %path.display(),
        responses = store.len(),
        bytes = store.bytes(),
        "stored responses loaded"
    );
    Ok(next_turn)
}

/// The store's side of loading and compacting.
impl ResponseStore {
    /// The live responses, least recently used first, as the journal writes them.
    fn snapshot(&self) -> Vec<PutOp> {
        snapshot(&self.inner.lock())
    }

    /// Inserts a response read from the journal (stored at `at`, `at_ms`), not journaling it.
    fn insert_loaded(
        &self,
        id: &str,
        tenant: &str,
        response: Value,
        turn: Arc<Turn>,
        at: Instant,
        at_ms: u64,
    ) {
        self.insert_at(id, tenant, response, turn, at, at_ms);
    }

    /// Removes a response the journal says was deleted.
    fn remove_loaded(&self, tenant: &str, id: &str) {
        let mut inner = self.inner.lock();
        inner.remove(&key(tenant, id), super::Gone::Deleted);
        inner.publish();
    }

    /// Lets every response past the age limit go (after loading, where the recency order is
    /// not the age order).
    fn expire_all(&self, now: Instant) {
        let Some(max_age) = self.limits.max_age else {
            return;
        };
        let mut inner = self.inner.lock();
        let expired: Vec<Key> = inner
            .entries
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.at) > max_age)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            inner.remove(&key, super::Gone::Evicted);
            metrics::counter!(RESPONSES_EVICTED, "reason" => "age").increment(1);
        }
        inner.publish();
    }
}

/// `inner`'s responses, least recently used first, as the journal writes them.
pub(super) fn snapshot(inner: &Inner) -> Vec<PutOp> {
    inner
        .order
        .values()
        .filter_map(|key| {
            let e = inner.entries.get(key)?;
            let running = matches!(
                e.stored.response["status"].as_str(),
                Some("queued" | "in_progress")
            );
            (!running).then(|| PutOp {
                tenant: key.0.clone(),
                id: key.1.clone(),
                at_ms: e.at_ms,
                response: e.stored.response.clone(),
                turn: Arc::clone(&e.stored.turn),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
