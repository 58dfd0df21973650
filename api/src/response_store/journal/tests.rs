use std::io::Write;
use std::sync::atomic::AtomicUsize;

use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use serde_json::json;

use super::*;
use crate::response_store::{Kept, StoreLimits};

/// Keeps the tests' lock files out of processes this binary spawns: a child holds a copy of
/// every descriptor open at its fork until it execs (close-on-exec closes them only then), and
/// a test that drops its store and opens it again within that window finds its own lock still
/// held (`Locked`; seen once in about 40 runs of the whole binary beside the FIFO test's
/// mkfifo(1)). A test holds a read guard while its directory lives; a spawn takes the write
/// guard.
static SPAWNS: parking_lot::RwLock<()> = parking_lot::const_rwlock(());

/// A fresh directory under the system's temporary one, removed when dropped.
struct TempDir(PathBuf, Option<parking_lot::RwLockReadGuard<'static, ()>>);

impl TempDir {
    fn new() -> Self {
        let mut dir = Self::unguarded();
        dir.1 = Some(SPAWNS.read());
        dir
    }

    /// A directory whose test spawns processes (and takes no lock in it).
    fn unguarded() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "switchyard-journal-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir, None)
    }

    fn log(&self) -> PathBuf {
        self.0.join(LOG_FILE)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).expect("the log")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn limits(max_responses: usize, max_bytes: usize, max_age_s: Option<u64>) -> StoreLimits {
    StoreLimits {
        max_responses,
        max_bytes,
        max_age: max_age_s.map(Duration::from_secs),
        ..StoreLimits::default()
    }
}

fn open(dir: &TempDir, limits: StoreLimits) -> ResponseStore {
    ResponseStore::open(limits, Some(&dir.0)).expect("opens")
}

fn turn(text: &str, parent: Option<Arc<Turn>>) -> Arc<Turn> {
    Arc::new(Turn::new(
        vec![json!({"type": "message", "role": "user", "content": text})],
        vec![json!({"type": "message", "role": "assistant", "content": format!("re: {text}")})],
        parent,
    ))
}

fn done(id: &str) -> Value {
    json!({"id": id, "status": "completed"})
}

/// Responses, a conversation continued across them, two tenants and a delete all read back
/// after a restart as they were.
#[test]
fn stored_responses_survive_a_restart() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(10, 1 << 20, None));
        let first = turn("first turn", None);
        s.insert("r1", "alice", done("r1"), Arc::clone(&first));
        s.insert("r2", "alice", done("r2"), turn("second turn", Some(first)));
        s.insert("r1", "bob", json!({"who": "bob"}), turn("bob's", None));
        s.insert("gone", "alice", done("gone"), turn("deleted", None));
        assert!(s.remove("alice", "gone"));
    }
    let s = open(&dir, limits(10, 1 << 20, None));
    assert_eq!(s.len(), 3);
    let r2 = s.get("alice", "r2").expect("r2");
    assert_eq!(r2.response, done("r2"));
    let items = r2.turn.items();
    assert_eq!(items.len(), 4);
    assert_eq!(items[0]["content"], "first turn");
    assert_eq!(items[3]["content"], "re: second turn");
    assert_eq!(r2.turn.input[0]["content"], "second turn");
    assert_eq!(s.get("alice", "r1").expect("r1").turn.items().len(), 2);
    assert_eq!(s.get("bob", "r1").expect("bob's").response["who"], "bob");
    assert!(s.get("alice", "gone").is_none());
    assert!(
        s.get("bob", "r2").is_none(),
        "alice's response is not bob's"
    );
    // The shared turn is in the log once (the restart's compaction kept it so).
    assert_eq!(s.bytes(), {
        let fresh = ResponseStore::new(limits(10, 1 << 20, None));
        let first = turn("first turn", None);
        fresh.insert("r1", "alice", done("r1"), Arc::clone(&first));
        fresh.insert("r2", "alice", done("r2"), turn("second turn", Some(first)));
        fresh.insert("r1", "bob", json!({"who": "bob"}), turn("bob's", None));
        fresh.bytes()
    });
    drop(s);
    assert_eq!(dir.log_text().matches("\"first turn\"").count(), 1);
}

/// The writer gives turns ids once: a conversation continued twice writes each turn once.
#[test]
fn a_turn_is_written_once_however_many_responses_continue_it() {
    let dir = TempDir::new();
    let s = open(&dir, limits(10, 1 << 20, None));
    let root = turn("shared root", None);
    let mid = turn("middle", Some(Arc::clone(&root)));
    s.insert("a", "t", done("a"), Arc::clone(&root));
    s.insert("b", "t", done("b"), Arc::clone(&mid));
    s.insert("c", "t", done("c"), turn("branch", Some(mid)));
    s.sync();
    let text = dir.log_text();
    assert_eq!(text.matches("\"shared root\"").count(), 1, "{text}");
    assert_eq!(text.matches("\"middle\"").count(), 1, "{text}");
}

/// A restart after a crash mid-write skips the torn last line and loads the rest; the start's
/// compaction leaves a clean log.
#[test]
fn a_torn_last_line_is_skipped() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(10, 1 << 20, None));
        s.insert("r1", "t", done("r1"), turn("kept", None));
    }
    let mut log = OpenOptions::new().append(true).open(dir.log()).unwrap();
    log.write_all(br#"{"op":"put","tenant":"t","id":"r2","at_ms":1,"tu"#)
        .unwrap();
    drop(log);
    let s = open(&dir, limits(10, 1 << 20, None));
    assert_eq!(s.len(), 1);
    assert!(s.get("t", "r1").is_some());
    drop(s);
    assert!(dir.log_text().ends_with('\n'));
    assert!(!dir.log_text().contains("\"r2\""));
}

/// A line longer than the byte bound is skipped without being held; the records after it load.
#[test]
fn a_line_larger_than_the_bound_is_skipped() {
    let dir = TempDir::new();
    let bound = limits(10, 4096, None);
    {
        let s = open(&dir, bound);
        assert_eq!(
            s.insert("r1", "t", done("r1"), turn("small", None)),
            Kept::Yes
        );
    }
    let text = dir.log_text();
    let (header, rest) = text.split_once('\n').unwrap();
    let huge = format!(
        "{{\"op\":\"delete\",\"tenant\":\"t\",\"id\":\"r1\",\"pad\":\"{}\"}}\n",
        "x".repeat(4096 + RECORD_ENVELOPE)
    );
    // A line of garbage and the oversized delete before the put, another after it: only the
    // oversized one could remove r1, and it is skipped.
    std::fs::write(
        dir.log(),
        format!("{header}\nnot json\n{rest}{huge}{{\"op\":\"frob\"}}\n"),
    )
    .unwrap();
    let s = open(&dir, bound);
    assert!(s.get("t", "r1").is_some());
}

/// Replacing one response many times grows the log with dead records until it is compacted to
/// about the live ones; what it holds then is the last version.
#[test]
fn the_log_is_compacted_when_dead_records_outweigh_live_ones() {
    let dir = TempDir::new();
    let s = open(&dir, limits(10, 8 << 20, None));
    let big = "y".repeat(100 << 10);
    for i in 0..40 {
        s.insert("r1", "t", json!({"v": i, "pad": big}), turn("t", None));
        s.sync();
    }
    let written = 40 * (100 << 10) as u64;
    let len = std::fs::metadata(dir.log()).unwrap().len();
    assert!(
        len <= 2 * (100 << 10) + COMPACT_FLOOR + (200 << 10),
        "{len} of {written} written"
    );
    drop(s);
    let s = open(&dir, limits(10, 8 << 20, None));
    assert_eq!(s.get("t", "r1").unwrap().response["v"], 39);
}

/// A restart drops what is past `max_age` by the time it was stored, and keeps the rest.
#[test]
fn responses_past_their_age_are_not_loaded() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(10, 1 << 20, None));
        let now = Instant::now();
        let ms = unix_ms();
        s.insert_at("old", "t", done("old"), turn("o", None), now, ms - 120_000);
        s.insert_at("new", "t", done("new"), turn("n", None), now, ms - 10_000);
    }
    let s = open(&dir, limits(10, 1 << 20, Some(60)));
    assert!(s.get("t", "old").is_none());
    assert!(s.get("t", "new").is_some());
}

/// A restart with smaller bounds keeps the most recently used responses.
#[test]
fn a_restart_applies_the_bounds_oldest_first() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(10, 1 << 20, None));
        for id in ["r1", "r2", "r3"] {
            s.insert(id, "t", done(id), turn(id, None));
        }
    }
    let s = open(&dir, limits(2, 1 << 20, None));
    assert_eq!(s.len(), 2);
    assert!(s.get("t", "r1").is_none());
    assert!(s.get("t", "r2").is_some() && s.get("t", "r3").is_some());
}

/// Evictions are journaled: a response the store let go does not come back at a restart.
#[test]
fn an_evicted_response_stays_gone() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(2, 1 << 20, None));
        s.insert("r1", "t", done("r1"), turn("1", None));
        s.insert("r2", "t", done("r2"), turn("2", None));
        // Reading r1 makes r2 the least recently used: it leaves, not r1.
        assert!(s.get("t", "r1").is_some());
        s.insert("r3", "t", done("r3"), turn("3", None));
    }
    let s = open(&dir, limits(10, 1 << 20, None));
    assert!(s.get("t", "r2").is_none());
    assert!(s.get("t", "r1").is_some() && s.get("t", "r3").is_some());
}

/// A background response still running is not journaled; once ended, it is.
#[test]
fn only_ended_responses_are_journaled() {
    let dir = TempDir::new();
    {
        let s = open(&dir, limits(10, 1 << 20, None));
        s.insert("bg", "t", json!({"status": "queued"}), turn("q", None));
        s.insert("bg2", "t", json!({"status": "completed"}), turn("q", None));
        s.insert("bg2", "t", json!({"status": "queued"}), turn("q", None));
        assert_eq!(s.len(), 2);
    }
    let s = open(&dir, limits(10, 1 << 20, None));
    assert!(s.is_empty(), "{s:?}");
}

/// A background response's life (stored `queued`, then `in_progress`, then ended) writes one
/// `put` and no `delete`: the log held nothing of that name to delete. A running response that
/// replaces an ended one of its name deletes that one, once.
#[test]
fn a_background_response_journals_one_put_and_no_delete() {
    let dir = TempDir::new();
    let s = open(&dir, limits(10, 1 << 20, None));
    s.sync();
    let records = |text: &str, op: &str| text.matches(&format!("\"op\":\"{op}\"")).count();
    for status in ["queued", "in_progress", "in_progress"] {
        s.insert("bg", "t", json!({"status": status}), turn("q", None));
    }
    s.insert("bg", "t", done("bg"), turn("q", None));
    s.sync();
    let text = dir.log_text();
    assert_eq!(
        (records(&text, "put"), records(&text, "delete")),
        (1, 0),
        "{text}"
    );
    // Run again under the same name: the ended one is deleted from the log once, then put.
    s.insert("bg", "t", json!({"status": "queued"}), turn("q2", None));
    s.insert(
        "bg",
        "t",
        json!({"status": "in_progress"}),
        turn("q2", None),
    );
    s.sync();
    let text = dir.log_text();
    assert_eq!(
        (records(&text, "put"), records(&text, "delete")),
        (1, 1),
        "{text}"
    );
    s.insert(
        "bg",
        "t",
        json!({"id": "bg", "status": "incomplete"}),
        turn("q2", None),
    );
    drop(s);
    let s = open(&dir, limits(10, 1 << 20, None));
    assert_eq!(s.get("t", "bg").unwrap().response["status"], "incomplete");
}

/// A second store on a directory in use is refused, naming it; once the first is gone the
/// directory is free.
#[test]
fn a_second_store_on_one_directory_is_refused() {
    let dir = TempDir::new();
    let first = open(&dir, limits(10, 1 << 20, None));
    let e = ResponseStore::open(limits(10, 1 << 20, None), Some(&dir.0)).unwrap_err();
    assert!(matches!(e, JournalError::Locked(_)), "{e}");
    assert!(e.to_string().contains(&dir.0.display().to_string()), "{e}");
    drop(first);
    open(&dir, limits(10, 1 << 20, None));
}

/// A log of another version, or not a log at all, refuses the start rather than being lost
/// by the start's compaction; a path that is a file is refused.
#[test]
fn unknown_versions_and_files_are_refused() {
    let dir = TempDir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    for text in [
        "{\"format\":\"switchyard-responses\",\"version\":99}\n",
        "{\"format\":\"other\",\"version\":1}\n",
        "hello\n",
        "hello",
    ] {
        std::fs::write(dir.log(), text).unwrap();
        let e = ResponseStore::open(limits(10, 1 << 20, None), Some(&dir.0)).unwrap_err();
        assert!(matches!(e, JournalError::UnknownVersion { .. }), "{e}");
        assert_eq!(std::fs::read_to_string(dir.log()).unwrap(), text);
    }
    let file = dir.0.join("a-file");
    std::fs::write(&file, "").unwrap();
    let e = ResponseStore::open(limits(10, 1 << 20, None), Some(&file)).unwrap_err();
    assert!(matches!(e, JournalError::NotADirectory(_)), "{e}");
}

/// A put whose conversation is not in the log (a hand-edited or damaged file), or with a turn
/// id too large to count on from, is skipped.
#[test]
fn a_put_without_its_conversation_is_skipped() {
    let dir = TempDir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    let header = json!({"format": "switchyard-responses", "version": 1});
    let orphan = json!({"op": "put", "tenant": "t", "id": "r1", "at_ms": unix_ms(),
        "turn": 7, "turns": [], "response": {}});
    let child = json!({"op": "put", "tenant": "t", "id": "r2", "at_ms": unix_ms(), "turn": 2,
        "turns": [{"id": 2, "parent": 1, "input": [], "output": []}], "response": {}});
    let fine = json!({"op": "put", "tenant": "t", "id": "r3", "at_ms": unix_ms(), "turn": 0,
        "turns": [{"id": 0, "parent": null, "input": ["x"], "output": []}], "response": {}});
    let huge_id = json!({"op": "put", "tenant": "t", "id": "r4", "at_ms": unix_ms(),
        "turn": u64::MAX, "turns": [{"id": u64::MAX, "parent": null, "input": [], "output": []}],
        "response": {}});
    std::fs::write(
        dir.log(),
        format!("{header}\n{orphan}\n{child}\n{fine}\n{huge_id}\n"),
    )
    .unwrap();
    let s = open(&dir, limits(10, 1 << 20, None));
    assert_eq!(s.len(), 1);
    // New turns get ids after those read, without overflow.
    s.insert("r5", "t", done("r5"), turn("new", None));
    s.sync();
    assert_eq!(s.get("t", "r3").unwrap().turn.items(), vec![json!("x")]);
}

#[test]
fn lines_are_read_within_their_bound() {
    let text = b"ab\ncdefgh\nij";
    let mut r = BufReader::new(&text[..]);
    let mut buf = Vec::new();
    assert_eq!(read_line(&mut r, &mut buf, 4).unwrap(), Ok(Some(true)));
    assert_eq!(buf, b"ab");
    assert_eq!(read_line(&mut r, &mut buf, 4).unwrap(), Err(7));
    assert!(buf.is_empty());
    assert_eq!(read_line(&mut r, &mut buf, 4).unwrap(), Ok(Some(false)));
    assert_eq!(buf, b"ij");
    assert_eq!(read_line(&mut r, &mut buf, 4).unwrap(), Ok(None));
}

/// A write that fails (a full disk: /dev/full) is counted, not fatal, and the next record
/// starts on a fresh line so that a half-written one cannot swallow it.
#[test]
fn a_failed_write_is_counted_and_the_next_record_starts_a_new_line() {
    let Ok(full) = OpenOptions::new().write(true).open("/dev/full") else {
        return;
    };
    let dir = TempDir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    let lock = File::create(dir.0.join(LOCK_FILE)).unwrap();
    let mut writer = Writer::new(
        dir.0.clone(),
        lock,
        0,
        Arc::new(Shared::default()),
        std::sync::Weak::new(),
    );
    writer.file = Some(full);
    let (recorder, handle) = local_recorder();
    let put = || PutOp {
        tenant: "t".into(),
        id: "r1".into(),
        at_ms: 0,
        response: json!({}),
        turn: turn("lost", None),
    };
    metrics::with_local_recorder(&recorder, || {
        writer.apply(Op::Put(put()), &mut Vec::new());
    });
    assert!(writer.broken_line);
    assert!(
        writer.written.is_empty(),
        "a turn not written is not marked written"
    );
    assert!(
        handle
            .render()
            .contains(&format!("{RESPONSES_JOURNAL_ERRORS} 1")),
        "{}",
        handle.render()
    );
    // The disk has room again: the record is written after a newline.
    writer.file = Some(File::create(dir.log()).unwrap());
    writer.apply(Op::Put(put()), &mut Vec::new());
    assert!(!writer.broken_line);
    assert!(
        dir.log_text().starts_with("\n{\"op\":\"put\""),
        "{}",
        dir.log_text()
    );
    assert!(dir.log_text().contains("\"lost\""));
}

/// A log larger than a store within the byte bound writes (the bound was lowered since it was
/// written) refuses the start and is left as it is: reading only its start would bring back a
/// response deleted at its end. Under the bound it was written with, the response stays gone.
#[test]
fn a_log_past_the_read_bound_refuses_the_start() {
    let dir = TempDir::new();
    let wide = limits(10_000, 8 << 20, None);
    {
        let s = open(&dir, wide);
        s.insert("r1", "t", done("r1"), turn("first", None));
        // Each about 4 KiB: more than the lowered bound below keeps, so none evicts r1.
        let big = "x".repeat(2048);
        for i in 0..300 {
            let id = format!("pad{i}");
            s.insert(&id, "t", done(&id), turn(&big, None));
        }
        assert!(s.remove("t", "r1"));
        s.sync();
    }
    let before = dir.log_text();
    let narrow = limits(10_000, 1024, None);
    assert!(before.len() as u64 > 1024 * MAX_READ_FACTOR + COMPACT_FLOOR);
    let e = ResponseStore::open(narrow, Some(&dir.0)).expect_err("a log past the bound");
    assert!(matches!(e, JournalError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("max_stored_mb"), "{e}");
    assert_eq!(dir.log_text(), before, "the log is untouched");
    let s = open(&dir, wide);
    assert!(s.get("t", "r1").is_none());
    assert_eq!(s.len(), 300);
}

/// A recorder of this thread's metrics (for `metrics::with_local_recorder`) and its handle.
fn local_recorder() -> (PrometheusRecorder, PrometheusHandle) {
    let recorder = crate::metrics::prometheus_builder()
        .expect("builder")
        .build_recorder();
    let handle = recorder.handle();
    (recorder, handle)
}

/// Stalls the writer of `s`'s journal until the returned sender is dropped, with a local
/// recorder (and its handle) to count the records dropped meanwhile.
fn stall(s: &ResponseStore) -> (mpsc::Sender<()>, PrometheusRecorder, PrometheusHandle) {
    let (release, held) = mpsc::channel();
    s.journal.as_ref().expect("a journal").hold(held);
    let (recorder, handle) = local_recorder();
    (release, recorder, handle)
}

/// The journaled errors counter as `handle` renders it.
fn errors(handle: &PrometheusHandle) -> u64 {
    let text = handle.render();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{RESPONSES_JOURNAL_ERRORS} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A writer stalled by a slow disk holds at most its queue: records past it are dropped and
/// counted, and the request path does not wait. Once the writer catches up it rewrites the log
/// from the store, so a dropped delete does not bring its response back at a restart, nor a
/// dropped put the response's older version.
#[test]
fn a_stalled_writer_drops_records_and_the_log_stays_true() {
    let dir = TempDir::new();
    let bound = limits(100, 1 << 20, None);
    let mut s = ResponseStore::new(bound);
    open_with(&dir.0, &mut s, 4).expect("opens");
    s.insert(
        "gone",
        "t",
        done("gone"),
        turn("deleted while stalled", None),
    );
    s.insert("v", "t", json!({"v": 1}), turn("v", None));
    s.sync();
    let (release, recorder, handle) = stall(&s);
    metrics::with_local_recorder(&recorder, || {
        for i in 0..4 {
            let id = format!("fill{i}");
            s.insert(&id, "t", done(&id), turn(&id, None));
        }
        assert_eq!(errors(&handle), 0, "the queue holds four");
        // Dropped: the queue is full, and nothing waits for the writer.
        assert!(s.remove("t", "gone"));
        s.insert("v", "t", json!({"v": 2}), turn("v", None));
        for i in 4..10 {
            let id = format!("fill{i}");
            s.insert(&id, "t", done(&id), turn(&id, None));
        }
        assert_eq!(errors(&handle), 8, "{}", handle.render());
    });
    drop(release);
    s.sync();
    assert!(!dir.log_text().contains("deleted while stalled"));
    drop(s);
    let s = open(&dir, bound);
    assert!(
        s.get("t", "gone").is_none(),
        "a dropped delete stays deleted"
    );
    assert_eq!(s.get("t", "v").expect("v").response["v"], 2);
    assert_eq!(s.len(), 11);
}

/// The queued records count at most the store's byte bound (one record is always let in).
#[test]
fn the_queue_holds_at_most_the_stores_bytes() {
    let dir = TempDir::new();
    let one = {
        let s = ResponseStore::new(limits(100, 1 << 20, None));
        s.insert("r0", "t", done("r0"), turn(&"x".repeat(1000), None));
        s.bytes()
    };
    let bound = limits(100, one * 5 / 2, None);
    let mut s = ResponseStore::new(bound);
    open_with(&dir.0, &mut s, 100).expect("opens");
    let (release, recorder, handle) = stall(&s);
    metrics::with_local_recorder(&recorder, || {
        for i in 0..3 {
            let id = format!("r{i}");
            s.insert(&id, "t", done(&id), turn(&"x".repeat(1000), None));
        }
        // Two fit in 2.5 responses' bytes; the third is dropped (its eviction of r0 is not).
        assert_eq!(errors(&handle), 1, "{}", handle.render());
    });
    drop(release);
    drop(s);
    let s = open(&dir, bound);
    assert!(s.get("t", "r0").is_none());
    assert!(s.get("t", "r1").is_some() && s.get("t", "r2").is_some());
}

/// A response read just before a restart is the most recently used after it, whether its
/// reads are in the log as `touch` records or the log was compacted since (written least
/// recently used first): the first eviction after the restart takes the one not read.
#[test]
fn recency_survives_a_restart_and_a_compaction() {
    let dir = TempDir::new();
    let bound = limits(3, 1 << 20, None);
    {
        let s = open(&dir, bound);
        for id in ["A", "B", "C"] {
            s.insert(id, "t", done(id), turn(id, None));
        }
        // Read three times: one record (a response already the latest is not touched again).
        for _ in 0..3 {
            assert!(s.get("t", "A").is_some());
        }
        s.sync();
        assert_eq!(dir.log_text().matches("\"op\":\"touch\"").count(), 1);
    }
    // The first restart replays the touch; its compaction writes A last.
    drop(open(&dir, bound));
    assert_eq!(dir.log_text().matches("\"op\":\"touch\"").count(), 0);
    let s = open(&dir, bound);
    s.insert("D", "t", done("D"), turn("D", None));
    assert!(s.get("t", "B").is_none(), "B was the least recently used");
    assert!(s.get("t", "A").is_some() && s.get("t", "C").is_some());
}

/// A lock file, log or compaction file that is there but is not a regular file refuses the
/// start, naming it: a FIFO would block the open until a writer came (the start hung), a
/// directory is not a log. Opened on a thread so that a hang fails the test instead of
/// stalling it.
#[test]
fn a_journal_file_that_is_not_a_regular_file_is_refused() {
    for name in [LOCK_FILE, LOG_FILE, TMP_FILE] {
        for fifo in [true, false] {
            let dir = TempDir::unguarded();
            std::fs::create_dir_all(&dir.0).unwrap();
            let path = dir.0.join(name);
            if fifo {
                let _no_lock_open = SPAWNS.write();
                let made = std::process::Command::new("mkfifo")
                    .arg(&path)
                    .status()
                    .expect("mkfifo runs");
                assert!(made.success());
            } else {
                std::fs::create_dir(&path).unwrap();
            }
            let (tx, rx) = mpsc::channel();
            let at = dir.0.clone();
            std::thread::spawn(move || {
                let _ = tx.send(ResponseStore::open(limits(10, 1 << 20, None), Some(&at)).err());
            });
            let e = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("{name} (fifo {fifo}): the open hangs"))
                .unwrap_or_else(|| panic!("{name} (fifo {fifo}): opened"));
            assert!(matches!(e, JournalError::NotAFile(_)), "{name}: {e}");
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
            // `config check` says so too.
            let why = check_directory(&dir.0).unwrap_err();
            assert!(why.contains(&path.display().to_string()), "{why}");
        }
    }
}

/// A symbolic link to a missing target as the path, or as a directory above it, is refused
/// naming the link and its target, by the start and by `config check` (create_dir_all said
/// only "File exists").
#[cfg(unix)]
#[test]
fn a_dangling_symbolic_link_is_refused_naming_it() {
    let dir = TempDir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    let link = dir.0.join("link");
    let target = dir.0.join("missing");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for path in [link.clone(), link.join("sub")] {
        let e = ResponseStore::open(limits(10, 1 << 20, None), Some(&path)).unwrap_err();
        assert!(matches!(e, JournalError::DanglingLink { .. }), "{e}");
        let why = check_directory(&path).unwrap_err();
        for text in [e.to_string(), why] {
            assert!(text.contains("symbolic link"), "{text}");
            assert!(text.contains(&link.display().to_string()), "{text}");
            assert!(text.contains(&target.display().to_string()), "{text}");
        }
        assert!(e.to_string().starts_with("server.responses.path"), "{e}");
    }
    // Once the target is there, the link is a directory like any other.
    std::fs::create_dir(&target).unwrap();
    check_directory(&link.join("sub")).unwrap();
    drop(ResponseStore::open(limits(10, 1 << 20, None), Some(&link.join("sub"))).unwrap());
    assert!(target.join("sub").join(LOG_FILE).is_file());
}
