use super::*;
use serde_json::json;

fn turn(text: &str, parent: Option<Arc<Turn>>) -> Arc<Turn> {
    Arc::new(Turn::new(
        vec![json!({"type": "message", "role": "user", "content": text})],
        vec![json!({"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": format!("re: {text}")}]})],
        parent,
    ))
}

fn store(max_responses: usize, max_bytes: usize, max_age: Option<u64>) -> ResponseStore {
    ResponseStore::new(StoreLimits {
        max_responses,
        max_bytes,
        max_age: max_age.map(Duration::from_secs),
        ..StoreLimits::default()
    })
}

/// A new store's series are on `/metrics` at once, each eviction reason at zero.
#[test]
fn a_new_store_exports_its_series_at_zero() {
    let recorder = crate::metrics::prometheus_builder()
        .expect("builder")
        .build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        store(4, 1 << 20, None);
    });
    let text = handle.render();
    for reason in ["count", "bytes", "age"] {
        let series = format!("{RESPONSES_EVICTED}{{reason=\"{reason}\"}} 0");
        assert!(text.contains(&series), "{series} missing in\n{text}");
    }
    for gauge in [RESPONSES_STORED, RESPONSES_STORED_BYTES] {
        assert!(text.contains(&format!("{gauge} 0")), "{gauge} missing");
    }
}

fn keep(s: &ResponseStore, id: &str, tenant: &str) -> Kept {
    s.insert(id, tenant, json!({"id": id}), turn(id, None))
}

#[test]
fn a_chain_reads_back_oldest_first() {
    let first = turn("a", None);
    let second = turn("b", Some(Arc::clone(&first)));
    let third = Arc::new(Turn::new(vec![json!("c")], vec![], Some(second)));
    assert_eq!(third.depth(), 3);
    let a = turn("a", None);
    let b = turn("b", None);
    let expected: Vec<Value> = [&a, &b]
        .iter()
        .flat_map(|t| t.input.iter().chain(&t.output))
        .cloned()
        .chain([json!("c")])
        .collect();
    assert_eq!(third.items(), expected);
    // Bytes add up along the chain.
    assert!(third.chain_bytes > first.chain_bytes * 2);
}

#[test]
fn the_least_recently_used_leaves_first_when_full() {
    let s = store(2, 1 << 20, None);
    assert_eq!(keep(&s, "r1", "t"), Kept::Yes);
    assert_eq!(keep(&s, "r2", "t"), Kept::Yes);
    // Reading r1 makes r2 the least recently used.
    assert!(s.get("t", "r1").is_some());
    assert_eq!(keep(&s, "r3", "t"), Kept::Yes);
    assert_eq!(s.len(), 2);
    assert!(s.get("t", "r2").is_none());
    assert!(s.get("t", "r1").is_some() && s.get("t", "r3").is_some());
}

#[test]
fn bytes_are_bounded_and_released() {
    let one = {
        let s = store(10, 1 << 20, None);
        keep(&s, "r1", "t");
        s.bytes()
    };
    assert!(one > 0);
    // Room for two responses of this size, not three.
    let s = store(10, one * 2 + one / 2, None);
    for id in ["r1", "r2", "r3"] {
        assert_eq!(keep(&s, id, "t"), Kept::Yes);
        assert!(s.bytes() <= one * 2 + one / 2);
    }
    assert_eq!(s.len(), 2);
    assert!(s.get("t", "r1").is_none());
    assert!(s.remove("t", "r2"));
    assert_eq!(s.bytes(), one);
    assert!(s.remove("t", "r3"));
    assert_eq!((s.len(), s.bytes()), (0, 0));
}

#[test]
fn a_response_larger_than_the_bound_is_not_kept() {
    let s = store(10, 64, None);
    assert_eq!(keep(&s, "r1", "t"), Kept::TooLarge);
    assert!(s.is_empty());
    let off = store(0, 1 << 20, None);
    assert_eq!(keep(&off, "r1", "t"), Kept::Disabled);
}

#[test]
fn responses_past_the_age_limit_are_gone() {
    let s = store(10, 1 << 20, Some(60));
    let t0 = Instant::now();
    s.insert_at("old", "t", json!({}), turn("old", None), t0, 0);
    s.insert_at(
        "new",
        "t",
        json!({}),
        turn("new", None),
        t0 + Duration::from_secs(50),
        0,
    );
    assert!(s.get_at("t", "old", t0 + Duration::from_secs(59)).is_some());
    assert!(s.get_at("t", "old", t0 + Duration::from_secs(61)).is_none());
    assert!(s.get_at("t", "new", t0 + Duration::from_secs(61)).is_some());
    // Inserting lets the expired least recently used ones go.
    s.insert_at(
        "later",
        "t",
        json!({}),
        turn("later", None),
        t0 + Duration::from_secs(200),
        0,
    );
    assert_eq!(s.len(), 1);
}

#[test]
fn another_tenant_sees_nothing_and_deletes_nothing() {
    let s = store(10, 1 << 20, None);
    keep(&s, "r1", "alice");
    assert!(s.get("bob", "r1").is_none());
    assert!(!s.remove("bob", "r1"));
    assert!(s.get("alice", "r1").is_some());
    assert!(s.remove("alice", "r1"));
    assert!(!s.remove("alice", "r1"));
}

#[test]
fn replacing_an_id_counts_it_once() {
    let s = store(10, 1 << 20, None);
    keep(&s, "r1", "t");
    let once = s.bytes();
    keep(&s, "r1", "t");
    assert_eq!((s.len(), s.bytes()), (1, once));
}

#[test]
fn a_continued_response_outlives_its_evicted_ancestor() {
    let s = store(1, 1 << 20, None);
    let first = turn("a", None);
    s.insert("r1", "t", json!({}), Arc::clone(&first));
    s.insert("r2", "t", json!({}), turn("b", Some(first)));
    assert!(s.get("t", "r1").is_none());
    assert_eq!(s.get("t", "r2").unwrap().turn.items().len(), 4);
}

/// A background response's `queued` entry, with `events`.
fn queued(id: &str, events: Option<Arc<EventLog>>) -> StoredResponse {
    StoredResponse {
        response: json!({"id": id, "status": "queued", "background": true}),
        turn: turn(id, None),
        events,
    }
}

/// Its end, `status`, with `events`.
fn end(id: &str, status: &str, events: Option<Arc<EventLog>>) -> StoredResponse {
    StoredResponse {
        response: json!({"id": id, "status": status, "background": true}),
        turn: turn(id, None),
        events,
    }
}

fn start(s: &ResponseStore, tenant: &str, id: &str) -> Option<u64> {
    let (abort, _registration) = AbortHandle::new_pair();
    s.start_background(tenant, id, abort, queued(id, None))
        .map(|(run, kept)| {
            assert_eq!(kept, Kept::Yes);
            run
        })
}

fn status(s: &ResponseStore, tenant: &str, id: &str) -> Option<Value> {
    s.get(tenant, id).map(|r| r.response["status"].clone())
}

fn cancel_event(n: u64) -> Bytes {
    Bytes::from(format!("cancelled {n}"))
}

#[test]
fn a_background_response_is_cancelled_once_and_only_by_its_tenant() {
    let s = store(10, 1 << 20, None);
    let (abort, registration) = AbortHandle::new_pair();
    let task = futures_util::future::Abortable::new(std::future::pending::<()>(), registration);
    let (run, _) = s
        .start_background("alice", "r1", abort, queued("r1", None))
        .expect("registered");
    assert_eq!(status(&s, "alice", "r1"), Some(json!("queued")));
    // The same id runs once per tenant at a time; another tenant's is its own.
    let (other, _r) = AbortHandle::new_pair();
    assert_eq!(
        s.start_background("alice", "r1", other.clone(), queued("r1", None)),
        None
    );
    let (bobs, _) = s
        .start_background("bob", "r1", other, queued("r1", None))
        .expect("bob's own");
    assert!(!task.is_aborted());
    let Cancel::Cancelled(response) = s.cancel_background("alice", "r1", cancel_event) else {
        panic!("not cancelled");
    };
    assert_eq!(response["status"], "cancelled");
    assert!(task.is_aborted());
    assert_eq!(status(&s, "alice", "r1"), Some(json!("cancelled")));
    // Its task learns that it was cancelled; a second cancel finds nothing running.
    let late = end("r1", "completed", None);
    assert_eq!(
        s.finish_background("alice", "r1", run, Vec::new(), late),
        None
    );
    assert_eq!(status(&s, "alice", "r1"), Some(json!("cancelled")));
    assert_eq!(
        s.cancel_background("alice", "r1", cancel_event),
        Cancel::NotRunning
    );
    // Bob's run is untouched, and ends by itself.
    let bobs_end = end("r1", "completed", None);
    assert_eq!(
        s.finish_background("bob", "r1", bobs, Vec::new(), bobs_end),
        Some(Kept::Yes)
    );
    assert_eq!(status(&s, "bob", "r1"), Some(json!("completed")));
    assert_eq!(
        s.cancel_background("bob", "r1", cancel_event),
        Cancel::NotRunning
    );
}

/// Regression (DELETE resurrected by a late end): a DELETE that lands after the task's run
/// ended but before its end is stored answered 200, then the end was stored anyway. Now
/// either the end comes first (and the DELETE removes it) or the DELETE does (and the end
/// is not stored): deleted stays deleted, in both orders, and the run is aborted.
#[test]
fn a_deleted_background_response_stays_deleted() {
    let s = store(10, 1 << 20, None);
    // The DELETE first.
    let (abort, registration) = AbortHandle::new_pair();
    let task = futures_util::future::Abortable::new(std::future::pending::<()>(), registration);
    let (run, _) = s
        .start_background("t", "r1", abort, queued("r1", None))
        .expect("registered");
    assert!(s.remove("t", "r1"));
    assert!(task.is_aborted());
    let late = end("r1", "completed", None);
    assert_eq!(s.finish_background("t", "r1", run, Vec::new(), late), None);
    assert!(s.get("t", "r1").is_none(), "the deleted response came back");
    assert_eq!(s.len(), 0);
    // The end first.
    let run = start(&s, "t", "r2").expect("registered");
    let done = end("r2", "completed", None);
    assert_eq!(
        s.finish_background("t", "r2", run, Vec::new(), done),
        Some(Kept::Yes)
    );
    assert!(s.remove("t", "r2"));
    assert!(s.get("t", "r2").is_none());
    // A cancel, then a DELETE: the cancel's store came after the DELETE's 200 before.
    start(&s, "t", "r3").expect("registered");
    assert!(matches!(
        s.cancel_background("t", "r3", cancel_event),
        Cancel::Cancelled(_)
    ));
    assert!(s.remove("t", "r3"));
    assert!(s.get("t", "r3").is_none());
    assert_eq!((s.len(), s.bytes()), (0, 0));
}

/// Regression (cancel undone by a late end): a cancel answered 200 stays `cancelled`: the
/// task's end, coming after it, stores nothing and writes none of its last events; its
/// events end with the cancel's event, numbered next.
#[test]
fn a_cancelled_background_response_stays_cancelled() {
    let s = store(10, 1 << 20, None);
    let log = EventLog::new();
    let (abort, _r) = AbortHandle::new_pair();
    let (run, _) = s
        .start_background("t", "r", abort, queued("r", Some(Arc::clone(&log))))
        .expect("registered");
    s.record_events(&log, vec![Bytes::from("e0"), Bytes::from("e1")], false);
    assert!(matches!(
        s.cancel_background("t", "r", cancel_event),
        Cancel::Cancelled(_)
    ));
    let late = end("r", "completed", Some(Arc::clone(&log)));
    let last = vec![Bytes::from("completed")];
    assert_eq!(s.finish_background("t", "r", run, last, late), None);
    assert_eq!(status(&s, "t", "r"), Some(json!("cancelled")));
    let frames = match log.read(0, 10, usize::MAX) {
        Read::Frames(frames, 3) => frames,
        other => panic!("{other:?}"),
    };
    assert_eq!(frames[2], cancel_event(2));
    assert_eq!(log.read(3, 10, usize::MAX), Read::Ended);
    assert_eq!(
        s.live_event_bytes(),
        0,
        "the cancelled log moved into its entry"
    );
    // A cancel of what no longer runs changes nothing.
    assert_eq!(
        s.cancel_background("t", "r", cancel_event),
        Cancel::NotRunning
    );
    assert_eq!(status(&s, "t", "r"), Some(json!("cancelled")));
}

/// A name is a background response's or stored foreground responses' at a time: each would
/// replace the other's entry, then be replaced by the other's end. Foreground ones share.
#[test]
fn a_name_is_background_or_foreground_at_a_time() {
    let s = Arc::new(store(10, 1 << 20, None));
    let first = s.claim_foreground("alice", "r1").expect("free");
    let second = s.claim_foreground("alice", "r1").expect("shared");
    assert_eq!(start(&s, "alice", "r1"), None);
    let bobs = start(&s, "bob", "r1").expect("bob's own");
    assert!(s.claim_foreground("bob", "r1").is_none());
    drop(first);
    assert_eq!(start(&s, "alice", "r1"), None);
    drop(second);
    let run = start(&s, "alice", "r1").expect("free again");
    assert!(s.claim_foreground("alice", "r1").is_none());
    let done = |id| end(id, "completed", None);
    assert!(s
        .finish_background("alice", "r1", run, Vec::new(), done("r1"))
        .is_some());
    assert!(s
        .finish_background("bob", "r1", bobs, Vec::new(), done("r1"))
        .is_some());
    assert!(s.claim_foreground("alice", "r1").is_some());
    assert!(s.foreground.lock().is_empty());
}

/// A running background response is never evicted nor expired: the count bound lets
/// finished responses go around it, and its entry stays readable until its end replaces
/// it, which then takes its place in the recency order.
#[test]
fn a_running_background_response_is_never_evicted() {
    let s = store(2, 1 << 20, Some(60));
    let run = start(&s, "t", "bg").expect("registered");
    let t0 = Instant::now();
    s.insert_at("a", "t", json!({}), turn("a", None), t0, 0);
    s.insert_at("b", "t", json!({}), turn("b", None), t0, 0);
    // The count bound: "a" left, not the older running "bg".
    assert!(s.get_at("t", "a", t0).is_none());
    assert!(s.get_at("t", "b", t0).is_some());
    // Past the age limit, the running one is still there.
    let later = t0 + Duration::from_secs(3600);
    assert!(s.get_at("t", "bg", later).is_some());
    assert!(s.get_at("t", "b", later).is_none());
    let done = end("bg", "completed", None);
    assert_eq!(
        s.finish_background("t", "bg", run, Vec::new(), done),
        Some(Kept::Yes)
    );
    keep(&s, "c", "t");
    keep(&s, "d", "t");
    assert!(
        s.get("t", "bg").is_none(),
        "ended, it is evicted as any other"
    );
}

/// A tenant choosing another's id (a client's X-Request-Id names its response) stores its
/// own response beside the other's, and deletes only its own.
#[test]
fn the_same_id_in_two_tenants_is_two_responses() {
    let s = store(10, 1 << 20, None);
    s.insert("r1", "alice", json!({"who": "alice"}), turn("a", None));
    s.insert("r1", "bob", json!({"who": "bob"}), turn("b", None));
    assert_eq!(s.len(), 2);
    assert!(s.remove("bob", "r1"));
    assert_eq!(s.get("alice", "r1").unwrap().response["who"], "alice");
}

#[test]
fn a_long_chain_drops_without_deep_recursion() {
    let mut t = turn("0", None);
    for i in 1..200_000 {
        t = Arc::new(Turn::new(vec![json!(i)], Vec::new(), Some(t)));
    }
    drop(t);
}

/// A resumed stream (`GET ?stream=true`) racing a DELETE has one outcome per order, for a
/// running response and an ended one: the DELETE first, the look finds nothing (a 404); the
/// look first, it holds the events, and its reader finds them deleted from any point (the
/// stream ends with `response_deleted`). The look takes the response and its events' span
/// under one lock, so nothing lands between them.
#[test]
fn a_stream_racing_a_delete_is_a_404_or_ends_deleted() {
    let s = Arc::new(store(10, 1 << 20, None));
    let started = |id: &str, ended: bool| {
        let log = EventLog::new();
        let (abort, _r) = AbortHandle::new_pair();
        let (run, _) = s
            .start_background("t", id, abort, queued(id, Some(Arc::clone(&log))))
            .expect("registered");
        s.record_events(&log, vec![Bytes::from("e0"), Bytes::from("e1")], false);
        if ended {
            let done = end(id, "completed", Some(Arc::clone(&log)));
            let last = vec![Bytes::from("completed")];
            assert_eq!(
                s.finish_background("t", id, run, last, done),
                Some(Kept::Yes)
            );
        }
    };
    for ended in [false, true] {
        // The DELETE first.
        started("r1", ended);
        assert!(s.remove("t", "r1"));
        assert!(s.get_for_stream("t", "r1").is_none());
        // The look first.
        started("r2", ended);
        let (stored, events) = s.get_for_stream("t", "r2").expect("found");
        assert_eq!(stored.response["id"], "r2");
        let (first, hold) = events.expect("its events");
        assert_eq!(first, 0);
        assert!(s.remove("t", "r2"));
        for next in 0..5 {
            assert_eq!(
                hold.log().read(next, 10, usize::MAX),
                Read::Gone(Gone::Deleted),
                "ended {ended}, from {next}"
            );
        }
        assert_eq!(hold.log().gone(), Some(Gone::Deleted));
        drop(hold);
        assert_eq!((s.len(), s.live_event_bytes()), (0, 0));
    }
    // A response without events is found with none.
    keep(&s, "plain", "t");
    let (_, events) = s.get_for_stream("t", "plain").expect("found");
    assert!(events.is_none());
}
