use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;

use super::*;
use crate::response_store::{Gone, Kept, StoredResponse, Turn};

fn store(max_bytes: usize) -> ResponseStore {
    ResponseStore::new(StoreLimits {
        max_responses: 100,
        max_bytes,
        max_age: Some(Duration::from_secs(3600)),
        ..StoreLimits::default()
    })
}

/// An event of exactly `len` bytes holding its number.
fn event(sequence: u64, len: usize) -> Bytes {
    let mut text = format!("{sequence}:");
    assert!(text.len() <= len);
    text.extend(std::iter::repeat_n('x', len - text.len()));
    Bytes::from(text)
}

fn events(range: std::ops::Range<u64>, len: usize) -> Vec<Bytes> {
    range.map(|i| event(i, len)).collect()
}

fn turn() -> Arc<Turn> {
    Arc::new(Turn::new(vec![json!("in")], vec![json!("out")], None))
}

/// Everything readable from `next` on, in batches of at most `batch` events.
fn read_all(log: &EventLog, mut next: u64, batch: usize) -> (Vec<Bytes>, Read) {
    let mut out = Vec::new();
    loop {
        match log.read(next, batch, usize::MAX) {
            Read::Frames(frames, after) => {
                assert_eq!(after, next + frames.len() as u64);
                next = after;
                out.extend(frames);
            }
            other => return (out, other),
        }
    }
}

/// Events are read back exactly from any sequence number on, in batches of any size; past
/// the last one a reader waits while the log runs, and finds it ended after its last event.
#[test]
fn a_log_replays_from_any_point_then_waits_then_ends() {
    let s = store(1 << 20);
    let log = EventLog::new();
    s.record_events(&log, events(0..5, 10), false);
    for from in 0..=5 {
        for batch in [1, 2, 100] {
            let (got, then) = read_all(&log, from, batch);
            assert_eq!(got, events(from..5, 10), "from {from}, batch {batch}");
            assert_eq!(then, Read::Wait);
        }
    }
    // Past the last event: a reader follows (waits for what comes).
    assert_eq!(log.read(1000, 10, 100), Read::Wait);
    s.record_events(&log, events(5..7, 10), true);
    assert_eq!(read_all(&log, 3, 2), (events(3..7, 10), Read::Ended));
    assert_eq!(log.read(1000, 10, 100), Read::Ended);
    // Nothing more once ended.
    s.record_events(&log, events(7..8, 10), false);
    assert_eq!(log.span(), (0, 7));
    // A batch stops at its byte budget, but always carries one event.
    assert_eq!(
        log.read(0, 100, 25),
        Read::Frames(events(0..2, 10), 2),
        "two of 10 bytes fit 25"
    );
    assert_eq!(log.read(0, 100, 1), Read::Frames(events(0..1, 10), 1));
}

/// A reader waiting on a log is woken by an append and by its end.
#[test]
fn readers_are_woken_by_each_change() {
    let s = store(1 << 20);
    let log = EventLog::new();
    let mut changes = log.subscribe();
    changes.borrow_and_update();
    assert!(!changes.has_changed().unwrap());
    s.record_events(&log, events(0..1, 10), false);
    assert!(changes.has_changed().unwrap());
    changes.borrow_and_update();
    s.end_events(&log, |n| event(n, 10));
    assert!(changes.has_changed().unwrap());
    assert_eq!(read_all(&log, 0, 10), (events(0..2, 10), Read::Ended));
}

/// One response keeps at most an eighth of the store's bytes of events: the oldest leave
/// first, and a reader behind them is told where the kept ones start.
#[test]
fn a_log_keeps_its_last_eighth_of_the_store() {
    let s = store(8000);
    assert_eq!(s.limits().max_event_bytes(), 1000);
    let log = EventLog::new();
    s.record_events(&log, events(0..250, 10), false);
    assert_eq!(log.span(), (150, 250));
    assert_eq!(log.bytes(), 1000);
    assert_eq!(s.live_event_bytes(), 1000);
    assert_eq!(log.read(149, 10, 1000), Read::Behind(150));
    assert_eq!(read_all(&log, 150, 7).0, events(150..250, 10));
    // One event larger than the bound stays alone: a reader that kept up still gets it.
    s.record_events(&log, vec![event(250, 3000)], false);
    assert_eq!(log.span(), (250, 251));
    assert_eq!(log.bytes(), 3000);
}

/// Running logs count against the store's byte bound: stored responses leave for them, least
/// recently used first, then the log's own oldest events; an ended log moves into its stored
/// entry's bytes, and leaves the count with it.
#[test]
fn running_logs_count_against_the_store_and_move_into_their_entry() {
    let s = store(8000);
    for id in ["a", "b", "c"] {
        assert_eq!(
            s.insert(id, "t", json!({"id": id, "pad": "p".repeat(2000)}), turn()),
            Kept::Yes
        );
    }
    let stored = s.bytes();
    assert!(stored > 6000 && stored < 7000, "{stored}");
    let logs: Vec<Arc<EventLog>> = (0..3).map(|_| EventLog::new()).collect();
    // 3 x 900 bytes of events: the least recently used stored responses make room.
    for log in &logs {
        s.record_events(log, events(0..90, 10), false);
    }
    assert_eq!(s.live_event_bytes(), 2700);
    assert!(
        s.get("t", "a").is_none(),
        "the least recently used left first"
    );
    assert!(s.get("t", "c").is_some());
    assert!(s.bytes() + s.live_event_bytes() <= 8000);
    // With nothing stored left to evict, a growing log drops its own oldest events.
    s.remove("t", "b");
    s.remove("t", "c");
    let big: Vec<Arc<EventLog>> = (0..6).map(|_| EventLog::new()).collect();
    for log in &big {
        s.record_events(log, events(0..100, 10), false);
    }
    assert_eq!(s.live_event_bytes(), 8000);
    assert_eq!(big[4].span(), (0, 100));
    assert_eq!(big[5].span(), (70, 100), "the last log dropped its oldest");

    // Ended and stored: the bytes move from the running logs' into the entry's.
    for log in big.iter().chain(&logs) {
        s.release_events(log);
    }
    assert_eq!(s.live_event_bytes(), 0);
    let log = EventLog::new();
    s.record_events(&log, events(0..50, 10), false);
    assert_eq!(
        s.insert_with_events("r", "t", json!({"id": "r"}), turn(), Some(Arc::clone(&log))),
        Kept::Yes
    );
    assert_eq!(
        s.live_event_bytes(),
        500,
        "a running log is only referred to"
    );
    s.record_events(&log, events(50..60, 10), true);
    let before = s.bytes();
    assert_eq!(
        s.insert_with_events(
            "r",
            "t",
            json!({"id": "r", "status": "completed"}),
            turn(),
            Some(Arc::clone(&log))
        ),
        Kept::Yes
    );
    assert_eq!(s.live_event_bytes(), 0);
    assert!(s.bytes() >= before + 600, "{} vs {before}", s.bytes());
    let kept = s.get("t", "r").expect("stored");
    assert!(Arc::ptr_eq(kept.events.as_ref().expect("events"), &log));
    s.remove("t", "r");
    assert_eq!(s.bytes(), 0);
}

/// A log ended by a cancel gets the cancel's event numbered next, and nothing after it (the
/// task's late events are dropped); releasing it stops its count.
#[test]
fn an_ended_log_takes_nothing_more() {
    let s = store(1 << 20);
    let log = EventLog::new();
    s.record_events(&log, events(0..3, 10), false);
    s.end_events(&log, |n| {
        assert_eq!(n, 3);
        event(n, 12)
    });
    s.end_events(&log, |_| panic!("ended once"));
    s.record_events(&log, events(3..5, 10), true);
    let (got, end) = read_all(&log, 0, 10);
    assert_eq!(end, Read::Ended);
    assert_eq!(got.len(), 4);
    assert_eq!(got[3], event(3, 12));
    assert_eq!(s.live_event_bytes(), 42);
    s.release_events(&log);
    s.release_events(&log);
    assert_eq!(s.live_event_bytes(), 0);
}

/// An ended response too large to keep with its events is kept without them.
#[test]
fn an_entry_too_large_with_its_events_is_kept_without_them() {
    let s = store(8000);
    let log = EventLog::new();
    s.record_events(&log, events(0..100, 10), true);
    let response = json!({"id": "r", "pad": "p".repeat(7200)});
    assert_eq!(
        s.insert_with_events("r", "t", response, turn(), Some(log)),
        Kept::Yes
    );
    assert!(s.get("t", "r").expect("kept").events.is_none());
    assert_eq!(s.live_event_bytes(), 0);
}

/// A running response whose `queued` entry is too large to keep still runs its stream: the
/// log is not ended by the refusal, its task's events go in and are read, and they stop
/// counting once the task releases them.
#[test]
fn a_running_log_outlives_an_entry_too_large_to_keep() {
    let s = store(1000);
    let log = EventLog::new();
    let queued = json!({"id": "r", "status": "queued", "pad": "p".repeat(2000)});
    assert_eq!(
        s.insert_with_events("r", "t", queued, turn(), Some(Arc::clone(&log))),
        Kept::TooLarge
    );
    assert!(!log.has_ended(), "the refusal ended a running log");
    s.record_events(&log, events(0..3, 10), false);
    assert_eq!(read_all(&log, 0, 10), (events(0..3, 10), Read::Wait));
    assert_eq!(s.live_event_bytes(), 30);
    s.record_events(&log, events(3..4, 10), true);
    let ended = json!({"id": "r", "status": "completed", "pad": "p".repeat(2000)});
    assert_eq!(
        s.insert_with_events("r", "t", ended, turn(), Some(Arc::clone(&log))),
        Kept::TooLarge
    );
    assert_eq!(read_all(&log, 0, 10), (events(0..4, 10), Read::Ended));
    assert_eq!(s.live_event_bytes(), 0);
}

fn stored(id: &str, status: &str, log: &Arc<EventLog>) -> StoredResponse {
    StoredResponse {
        response: json!({"id": id, "status": status}),
        turn: turn(),
        events: Some(Arc::clone(log)),
    }
}

/// Regression (a running response evicted by its own events): its growing log made the store
/// evict its own `queued` entry (the least recently used), and GET and resume were 404s until
/// its end was stored. Now finished responses leave first, then the log's own oldest events;
/// the running entry stays.
#[test]
fn a_running_response_is_not_evicted_by_its_own_events() {
    let s = store(8000);
    let log = EventLog::new();
    let (abort, _r) = futures_util::future::AbortHandle::new_pair();
    let (run, kept) = s
        .start_background("t", "r", abort, stored("r", "queued", &log))
        .expect("registered");
    assert_eq!(kept, Kept::Yes);
    for id in ["a", "b", "c"] {
        let pad = json!({"id": id, "pad": "p".repeat(2300)});
        assert_eq!(s.insert(id, "t", pad, turn()), Kept::Yes);
    }
    // 1000 bytes of events: "a", the least recently used finished one, leaves for them.
    s.record_events(&log, events(0..100, 10), false);
    assert!(s.get("t", "r").is_some(), "evicted by its own events");
    assert!(s.get("t", "a").is_none());
    assert_eq!(log.span(), (0, 100));
    // With no finished response left, the log drops its own oldest events instead.
    s.remove("t", "b");
    s.remove("t", "c");
    let others: Vec<Arc<EventLog>> = (0..7).map(|_| EventLog::new()).collect();
    for other in &others {
        s.record_events(other, events(0..100, 10), false);
    }
    s.record_events(&log, events(100..150, 10), false);
    assert!(s.bytes() + s.live_event_bytes() <= 8000);
    assert!(s.get("t", "r").is_some(), "evicted by its own events");
    let (first, end) = log.span();
    assert!(first > 0 && end == 150, "{first}..{end}");
    let done = stored("r", "completed", &log);
    let last = events(150..151, 10);
    assert_eq!(
        s.finish_background("t", "r", run, last, done),
        Some(Kept::Yes)
    );
    assert_eq!(
        s.get("t", "r").expect("stored").response["status"],
        "completed"
    );
}

/// Regression (readers keeping dropped events alive, uncounted): a reader of a response that
/// left the store (evicted, deleted, or replaced by another of its name) held its events until
/// it ended. Now they are dropped at once, and the reader finds why.
#[test]
fn the_events_of_a_response_that_leaves_are_dropped_at_once() {
    let s = store(8000);
    let ended = |id: &str| {
        let log = EventLog::new();
        s.record_events(&log, events(0..90, 10), true);
        s.insert_with_events(id, "t", json!({"id": id}), turn(), Some(Arc::clone(&log)));
        assert!(matches!(log.read(0, 10, usize::MAX), Read::Frames(..)));
        log
    };
    // Evicted.
    let log = ended("r");
    for id in ["a", "b", "c", "d"] {
        s.insert(id, "t", json!({"id": id, "pad": "p".repeat(2000)}), turn());
    }
    assert!(s.get("t", "r").is_none(), "evicted");
    assert_eq!(
        log.bytes(),
        0,
        "a reader holds an evicted response's events"
    );
    assert_eq!(log.read(5, 10, usize::MAX), Read::Gone(Gone::Evicted));
    // Deleted.
    let log = ended("r");
    assert!(s.remove("t", "r"));
    assert_eq!(log.bytes(), 0);
    assert_eq!(log.read(0, 10, usize::MAX), Read::Gone(Gone::Deleted));
    // Replaced by another response of its name.
    let log = ended("r");
    s.insert("r", "t", json!({"id": "r", "again": true}), turn());
    assert_eq!(log.read(0, 10, usize::MAX), Read::Gone(Gone::Replaced));
    // A running one deleted: its task's later events are dropped, and nothing counts.
    let log = EventLog::new();
    let (abort, _r) = futures_util::future::AbortHandle::new_pair();
    let (run, _) = s
        .start_background("t", "bg", abort, stored("bg", "queued", &log))
        .expect("registered");
    s.record_events(&log, events(0..10, 10), false);
    assert!(s.remove("t", "bg"));
    assert_eq!(s.live_event_bytes(), 0);
    s.record_events(&log, events(10..20, 10), false);
    let late = stored("bg", "completed", &log);
    assert_eq!(s.finish_background("t", "bg", run, Vec::new(), late), None);
    assert_eq!(log.read(0, 10, usize::MAX), Read::Gone(Gone::Deleted));
    assert_eq!((log.bytes(), s.live_event_bytes()), (0, 0));
    // A log handed from the `queued` entry to its end's stays.
    let log = EventLog::new();
    let (abort, _r) = futures_util::future::AbortHandle::new_pair();
    let (run, _) = s
        .start_background("t", "bg2", abort, stored("bg2", "queued", &log))
        .expect("registered");
    let done = stored("bg2", "completed", &log);
    s.finish_background("t", "bg2", run, events(0..3, 10), done);
    assert_eq!(read_all(&log, 0, 10), (events(0..3, 10), Read::Ended));
}

/// An entry holding events still written stays out of the eviction order even unregistered:
/// its log's own growth drops its oldest events, never the entry (evicting it would close the
/// very log being appended to, under that log's lock).
#[test]
fn an_entry_with_running_events_is_not_evicted_by_them() {
    let s = store(8000);
    let log = EventLog::new();
    let queued = json!({"id": "r", "status": "queued"});
    assert_eq!(
        s.insert_with_events("r", "t", queued, turn(), Some(Arc::clone(&log))),
        Kept::Yes
    );
    for id in ["a", "b", "c"] {
        let pad = json!({"id": id, "pad": "p".repeat(2300)});
        assert_eq!(s.insert(id, "t", pad, turn()), Kept::Yes);
    }
    s.record_events(&log, events(0..100, 10), false);
    assert!(s.get("t", "r").is_some());
    assert!(s.get("t", "a").is_none(), "a finished one left instead");
    assert_eq!(log.span(), (0, 100));
}

/// Regression (a response not kept left uncounted events to its readers): a background
/// response whose end was too large to keep with its events released them at once, and the
/// streams following it live read them to their end uncounted (up to an eighth of the bound
/// each). Now they count against the bound for as long as a reader holds them, and stop
/// counting when the last one lets go; without a reader they stop at once.
#[test]
fn the_events_of_a_response_not_kept_count_while_readers_hold_them() {
    let s = Arc::new(store(8000));
    let log = EventLog::new();
    let (abort, _r) = futures_util::future::AbortHandle::new_pair();
    let (run, _) = s
        .start_background("t", "r", abort, stored("r", "queued", &log))
        .expect("registered");
    // Two readers following it live (the POST's answer and a resume).
    let readers = [s.hold_events(&log), s.hold_events(&log)];
    s.record_events(&log, events(0..50, 10), false);
    assert_eq!(s.live_event_bytes(), 500);
    // Its end fits alone, not with its 510 bytes of events: kept without them.
    let end = StoredResponse {
        response: json!({"id": "r", "status": "completed", "pad": "p".repeat(7500)}),
        turn: turn(),
        events: Some(Arc::clone(&log)),
    };
    let last = events(50..51, 10);
    assert_eq!(
        s.finish_background("t", "r", run, last, end),
        Some(Kept::Yes)
    );
    assert!(s.get("t", "r").expect("kept").events.is_none());
    s.release_events(&log);
    assert_eq!(
        (s.live_event_bytes(), s.logs_kept_for_readers()),
        (510, 1),
        "counted while read"
    );
    // The readers read them to their end.
    for reader in &readers {
        assert_eq!(
            read_all(reader.log(), 0, 7),
            (events(0..51, 10), Read::Ended)
        );
    }
    let [first, second] = readers;
    drop(first);
    assert_eq!(s.live_event_bytes(), 510, "one reader still holds them");
    drop(second);
    assert_eq!((s.live_event_bytes(), s.logs_kept_for_readers()), (0, 0));

    // Without a reader, a response too large to keep at all stops counting at its end.
    let log = EventLog::new();
    let pad = "p".repeat(9000);
    let big = |status: &str| StoredResponse {
        response: json!({"id": "big", "status": status, "pad": pad}),
        turn: turn(),
        events: Some(Arc::clone(&log)),
    };
    let (abort, _r) = futures_util::future::AbortHandle::new_pair();
    let (run, kept) = s
        .start_background("t", "big", abort, big("queued"))
        .expect("registered");
    assert_eq!(kept, Kept::TooLarge);
    s.record_events(&log, events(0..5, 10), false);
    let reader = s.hold_events(&log);
    assert_eq!(
        s.finish_background("t", "big", run, events(5..6, 10), big("completed")),
        Some(Kept::TooLarge)
    );
    s.release_events(&log);
    assert_eq!(s.live_event_bytes(), 60, "its reader holds them");
    assert_eq!(
        read_all(reader.log(), 3, 10),
        (events(3..6, 10), Read::Ended)
    );
    drop(reader);
    assert_eq!((s.live_event_bytes(), s.logs_kept_for_readers()), (0, 0));
    assert!(s.get("t", "big").is_none());
}

/// The events kept for readers alone make room for a growing running log once no stored
/// response is left to go, oldest first (their readers end with `response_evicted`), before
/// the running log drops its own oldest events: what readers hold never passes the bound.
/// A stored response does not evict them (the store may pass its bound by that response, as
/// it may for running logs).
#[test]
fn events_kept_for_readers_make_room_for_running_responses() {
    let s = Arc::new(store(8000));
    // Eight logs of 1000 bytes (the most one keeps), each still read: the whole bound.
    let mut held = Vec::new();
    for _ in 0..8 {
        let log = EventLog::new();
        held.push(s.hold_events(&log));
        s.record_events(&log, events(0..100, 10), true);
        s.release_events(&log);
    }
    assert_eq!((s.live_event_bytes(), s.logs_kept_for_readers()), (8000, 8));
    assert_eq!(
        s.insert("a", "t", json!({"id": "a", "pad": "p".repeat(500)}), turn()),
        Kept::Yes
    );
    assert_eq!(
        s.logs_kept_for_readers(),
        8,
        "a stored response evicts none"
    );
    let running = EventLog::new();
    // 500 bytes: "a" leaves first, then the oldest log kept for readers.
    s.record_events(&running, events(0..50, 10), false);
    assert!(s.get("t", "a").is_none());
    assert_eq!(
        held[0].log().read(0, 10, usize::MAX),
        Read::Gone(Gone::Evicted)
    );
    for kept in &held[1..] {
        assert!(matches!(
            kept.log().read(0, 10, usize::MAX),
            Read::Frames(..)
        ));
    }
    assert_eq!(running.span(), (0, 50), "nothing of its own dropped");
    assert_eq!((s.live_event_bytes(), s.logs_kept_for_readers()), (7500, 7));
    assert!(s.bytes() + s.live_event_bytes() <= 8000);
    // Their readers gone, only the running log counts.
    held.clear();
    assert_eq!(s.live_event_bytes(), 500);
    s.release_events(&running);
    assert_eq!(s.live_event_bytes(), 0);
}
