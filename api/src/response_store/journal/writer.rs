//! The thread that writes the journal's log: it applies the records the store queues, in order,
//! `fdatasync`s whenever it has caught up (group commit), compacts when asked, and rewrites the
//! log from the store itself once it has caught up after the store dropped a record (see
//! [`super::QUEUE_RECORDS`]).

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{
    snapshot, Header, Op, PutOp, Record, Shared, TurnRecord, FORMAT, LOG_FILE, TMP_FILE, VERSION,
};
use crate::metrics::RESPONSES_JOURNAL_ERRORS;
use crate::response_store::Inner;

/// How long the writer waits for a record before it looks again whether the log must be
/// rewritten (a record dropped while it was catching up).
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// Records applied between two syncs of the log at most (a quarter of the queue's bound).
const BATCH_RECORDS: usize = super::QUEUE_RECORDS / 4;
/// After a rewrite from the store failed (a full disk), the next try waits this long.
const RESYNC_RETRY: Duration = Duration::from_secs(10);

/// A queued record and the bytes it counts against [`super::Journal`]'s byte bound.
pub(super) type Queued = (Op, usize);

/// The thread that writes the log.
pub(super) struct Writer {
    dir: PathBuf,
    /// The log, open for appending (`None` only before the first compaction).
    pub(super) file: Option<File>,
    /// Turns in the log now.
    pub(super) written: HashSet<u64>,
    next_turn: u64,
    /// The last write failed, perhaps halfway: the next record starts on a new line.
    pub(super) broken_line: bool,
    /// What the store and the writer share: the log's size, the flags, the queued bytes.
    shared: Arc<Shared>,
    /// The store's responses, read to rewrite the log after a dropped record.
    store: Weak<Mutex<Inner>>,
    /// No rewrite from the store before this (one failed).
    resync_after: Option<Instant>,
    /// Held as long as the writer runs (the process, in a server).
    _lock: File,
}

impl Writer {
    /// A writer of the log in `dir`, giving turns ids from `next_turn` on; it opens the log at
    /// its first compaction.
    pub(super) fn new(
        dir: PathBuf,
        lock: File,
        next_turn: u64,
        shared: Arc<Shared>,
        store: Weak<Mutex<Inner>>,
    ) -> Self {
        Self {
            dir,
            file: None,
            written: HashSet::new(),
            next_turn,
            broken_line: false,
            shared,
            store,
            resync_after: None,
            _lock: lock,
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Queued>) {
        let mut replies = Vec::new();
        loop {
            let first = match rx.recv_timeout(IDLE_CHECK) {
                Ok(q) => Some(q),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let mut dirty = false;
            if let Some(q) = first {
                dirty |= self.take(q, &mut replies);
                // At most a batch between syncs: under a queue that never empties, the log is
                // still synced and the syncs asked for answered every BATCH_RECORDS records.
                for _ in 1..BATCH_RECORDS {
                    let Ok(q) = rx.try_recv() else { break };
                    dirty |= self.take(q, &mut replies);
                }
            }
            // Caught up: a record dropped meanwhile is made good before syncs are answered.
            self.resync_if_lost(&rx, &mut replies);
            self.finish_batch(dirty, &mut replies);
        }
        // Every record sent is applied; the store is still there (it drops its journal first).
        self.resync_after = None;
        self.resync_if_lost(&rx, &mut replies);
        self.finish_batch(true, &mut replies);
    }

    /// Syncs the log if `dirty` and answers the syncs asked for.
    fn finish_batch(&mut self, dirty: bool, replies: &mut Vec<mpsc::Sender<()>>) {
        if dirty || !replies.is_empty() {
            if let Some(file) = &self.file {
                if let Err(e) = file.sync_data() {
                    self.failed("cannot sync the log", &e);
                }
            }
        }
        for reply in replies.drain(..) {
            let _ = reply.send(());
        }
    }

    /// Applies a queued record and gives its bytes back to the bound; whether it wrote.
    fn take(&mut self, (op, weight): Queued, replies: &mut Vec<mpsc::Sender<()>>) -> bool {
        let wrote = self.apply(op, replies);
        self.shared.queued_bytes.fetch_sub(weight, Ordering::AcqRel);
        wrote
    }

    /// Rewrites the log from the store when the store dropped a record (its queue full), so
    /// that the log says what the store holds again: a dropped delete would otherwise bring
    /// its response back at a restart, a dropped put its older version.
    ///
    /// Under the store's lock, where the store sends every record, what is still queued was
    /// sent before the snapshot taken here, which holds its effect: it is discarded (its syncs
    /// answered once the new log is synced).
    fn resync_if_lost(&mut self, rx: &mpsc::Receiver<Queued>, replies: &mut Vec<mpsc::Sender<()>>) {
        if !self.shared.lost.load(Ordering::Acquire)
            || self.resync_after.is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        let Some(store) = self.store.upgrade() else {
            return;
        };
        let live = {
            let inner = store.lock();
            while let Ok((op, weight)) = rx.try_recv() {
                self.shared.queued_bytes.fetch_sub(weight, Ordering::AcqRel);
                match op {
                    Op::Sync(reply) => replies.push(reply),
                    Op::Compact(_) => self.shared.compacting.store(false, Ordering::Release),
                    _ => {}
                }
            }
            self.shared.lost.store(false, Ordering::Release);
            snapshot(&inner)
        };
        drop(store);
        let responses = live.len();
        match self.compact(live) {
            Ok(()) => {
                self.resync_after = None;
                tracing::info!(
                    path = %self.dir.join(LOG_FILE).display(),
                    responses,
                    "the responses journal caught up after dropping records: its log is \
                     rewritten from the store"
                );
            }
            Err(e) => {
                self.shared.lost.store(true, Ordering::Release);
                self.resync_after = Some(Instant::now() + RESYNC_RETRY);
                self.failed("cannot rewrite the log after dropped records", &e);
            }
        }
    }

    fn failed(&mut self, what: &str, e: &dyn std::fmt::Display) {
        tracing::error!(
            path = %self.dir.join(LOG_FILE).display(),
            error = %e,
            "{what}: stored responses changed since may be lost at a restart"
        );
        metrics::counter!(RESPONSES_JOURNAL_ERRORS).increment(1);
    }

    /// Applies one op; whether it wrote a change that is to be synced.
    pub(super) fn apply(&mut self, op: Op, replies: &mut Vec<mpsc::Sender<()>>) -> bool {
        match op {
            Op::Put(put) => {
                let (record, new) = put_record(&mut self.next_turn, &self.written, put);
                let ok = self.append(&record);
                if ok {
                    self.written.extend(new);
                }
                true
            }
            Op::Delete { tenant, id } => {
                self.append(&Record::Delete { tenant, id });
                true
            }
            // Recency only: synced with the next change, as losing it loses nothing stored.
            Op::Touch { tenant, id } => {
                self.append(&Record::Touch { tenant, id });
                false
            }
            Op::Compact(snapshot) => {
                if let Err(e) = self.compact(snapshot) {
                    self.failed("cannot compact the log", &e);
                }
                self.shared.compacting.store(false, Ordering::Release);
                false
            }
            Op::Sync(reply) => {
                replies.push(reply);
                false
            }
            #[cfg(test)]
            Op::Hold { entered, release } => {
                let _ = entered.send(());
                let _ = release.recv();
                false
            }
        }
    }

    /// Appends `record` as one line; whether it was written.
    fn append(&mut self, record: &Record) -> bool {
        let mut line = Vec::new();
        if self.broken_line {
            line.push(b'\n');
        }
        if let Err(e) = serde_json::to_writer(&mut line, record) {
            self.failed("cannot write a record", &e);
            return false;
        }
        line.push(b'\n');
        let Some(file) = self.file.as_mut() else {
            self.failed("cannot write a record", &"the log is not open");
            return false;
        };
        match file.write_all(&line) {
            Ok(()) => {
                self.broken_line = false;
                self.shared
                    .file_bytes
                    .fetch_add(line.len() as u64, Ordering::Relaxed);
                true
            }
            Err(e) => {
                self.broken_line = true;
                self.failed("cannot write a record", &e);
                false
            }
        }
    }

    /// Rewrites the log as `snapshot` (least recently used first, so that a reload restores
    /// the recency order) into a temporary file, synced, then renamed over it.
    pub(super) fn compact(&mut self, snapshot: Vec<PutOp>) -> std::io::Result<()> {
        let log = self.dir.join(LOG_FILE);
        let tmp = self.dir.join(TMP_FILE);
        // A FIFO put there since the start would block this thread for good.
        if std::fs::metadata(&tmp).is_ok_and(|m| !m.is_file()) {
            return Err(std::io::Error::other(format!(
                "`{}` is not a regular file",
                tmp.display()
            )));
        }
        let mut out = std::io::BufWriter::new(File::create(&tmp)?);
        let header = Header {
            format: FORMAT.into(),
            version: VERSION,
        };
        serde_json::to_writer(&mut out, &header)?;
        out.write_all(b"\n")?;
        let mut bytes = 0u64;
        // Swapped in only once the new log is in place: the old one stays in use otherwise.
        let mut written = HashSet::new();
        for put in snapshot {
            let (record, new) = put_record(&mut self.next_turn, &written, put);
            let mut line = serde_json::to_vec(&record)?;
            line.push(b'\n');
            out.write_all(&line)?;
            bytes += line.len() as u64;
            written.extend(new);
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, &log)?;
        // The renamed file is the log now: records go on through this handle (its offset is at
        // its end), so none can go to the replaced file, whatever fails below.
        let len = file.metadata().map_or(bytes, |m| m.len());
        self.file = Some(file);
        self.written = written;
        self.broken_line = false;
        self.shared
            .file_bytes
            .store(len.max(bytes), Ordering::Relaxed);
        // The rename itself is durable once the directory is synced; failing that, the log
        // in use is still whole (only whether the rename survives a power loss is in doubt).
        File::open(&self.dir)?.sync_all()
    }
}

/// The record of `put`, with the turns of its conversation not in `written` (their ids given
/// now from `next_turn` if they had none), and those turns' ids.
fn put_record(next_turn: &mut u64, written: &HashSet<u64>, put: PutOp) -> (Record, Vec<u64>) {
    let mut chain = Vec::new();
    let mut at = Some(&*put.turn);
    while let Some(t) = at {
        if t.journal_id.get().is_some_and(|id| written.contains(id)) {
            break;
        }
        chain.push(t);
        at = t.parent.as_deref();
    }
    let mut ids = Vec::with_capacity(chain.len());
    let mut turns = Vec::with_capacity(chain.len());
    for t in chain.into_iter().rev() {
        let id = *t.journal_id.get_or_init(|| {
            let id = *next_turn;
            *next_turn += 1;
            id
        });
        let parent = t.parent.as_ref().and_then(|p| p.journal_id.get().copied());
        ids.push(id);
        turns.push(TurnRecord {
            id,
            parent,
            input: t.input.clone(),
            output: t.output.clone(),
        });
    }
    let turn = *put.turn.journal_id.get().unwrap_or(&0);
    let record = Record::Put {
        tenant: put.tenant,
        id: put.id,
        at_ms: put.at_ms,
        turn,
        turns,
        response: put.response,
    };
    (record, ids)
}
