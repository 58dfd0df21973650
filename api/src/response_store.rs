//! Stored responses of the Responses API: what `GET /v1/responses/{id}`, its `input_items`,
//! `DELETE` and a later request's `previous_response_id` read.
//!
//! A response created with `store` (OpenAI's default) that ended `completed` or `incomplete` is
//! kept with its conversation: a [`Turn`] holding the request's input items and the response's
//! output items after the turn it continued. Turns are shared (`Arc`) along a chain, so a
//! conversation of many turns holds each turn once, and a response whose ancestor was evicted
//! or deleted still continues (it holds the turns it was answered with).
//!
//! The store is bounded three ways ([`StoreLimits`]): the most responses, the most bytes (a
//! response counts its object and the serialized items of its whole conversation, so what the
//! store keeps alive, shared turns included, never exceeds the bound), and an age. The least
//! recently used response leaves first when a bound would be passed; one response larger than
//! the byte bound is not kept. Every operation is O(log n). A background response created with
//! `stream` keeps its events with it ([`events`]): counted against the byte bound too, while it
//! runs and once stored, and never journaled.
//!
//! Responses are kept per tenant: a response is found only by requests of the tenant that
//! created it (an open server is one tenant), and another tenant's id reads as unknown, so
//! nothing tells one tenant what another stored.
//!
//! With a directory (`server.responses.path`) the store is journaled there ([`journal`]): each
//! change (reads too, as recency) is queued, under the store's lock, for a writer thread that
//! appends it to a log, and a start replays the log within the same bounds, so stored
//! responses, their conversations and their recency order survive a restart. The queue is
//! bounded and never waited on: a change that finds it full is dropped, and the writer
//! rewrites the log from the store once it has caught up. A background response is journaled once it has ended (a `queued` one
//! would never end after a restart).

use std::collections::hash_map::Entry as Entry_;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::future::AbortHandle;
use parking_lot::Mutex;
use serde_json::Value;

use crate::metrics::{
    RESPONSES_EVICTED, RESPONSES_JOURNAL_ERRORS, RESPONSES_STORED, RESPONSES_STORED_BYTES,
};

pub mod events;
pub mod journal;

pub use events::{EventLog, Read};
pub use journal::{ensure_directory, JournalError};

/// Most turns in one conversation chained by `previous_response_id`.
pub const MAX_CHAIN_DEPTH: usize = 1024;

/// [`StoreLimits::off_because`] where `server.responses.max_stored` turned storing off.
pub const MAX_STORED_IS_ZERO: &str = "server.responses.max_stored is 0";

/// The store's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most responses kept; 0 keeps none (storing is off).
    pub max_responses: usize,
    /// Most bytes kept (see the module docs for what a response counts).
    pub max_bytes: usize,
    /// Oldest response kept, from when it was stored; `None`: no age limit.
    pub max_age: Option<Duration>,
    /// Why storing is off, when it is (not [`StoreLimits::enabled`]): what the API's refusals
    /// of `background` and `previous_response_id` name, e.g. the setting that turned it off.
    pub off_because: &'static str,
}

impl StoreLimits {
    /// Whether anything can be stored.
    pub fn enabled(&self) -> bool {
        self.max_responses > 0 && self.max_bytes > 0
    }
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            max_responses: 10_000,
            max_bytes: 256 << 20,
            max_age: Some(Duration::from_secs(24 * 3600)),
            off_because: MAX_STORED_IS_ZERO,
        }
    }
}

/// One turn of a conversation: a request's input items and its response's output items, after
/// the turn it continued.
#[derive(Debug)]
pub struct Turn {
    /// The request's input items, as `input_items` lists them.
    pub input: Vec<Value>,
    /// The response's output items.
    pub output: Vec<Value>,
    parent: Option<Arc<Turn>>,
    /// Turns in the conversation up to this one.
    depth: usize,
    /// Serialized bytes of this turn's items and its ancestors'.
    chain_bytes: usize,
    /// Its id in the journal, once written there (or read from there).
    journal_id: OnceLock<u64>,
}

impl Turn {
    /// A turn of `input` and `output` after `parent`.
    pub fn new(input: Vec<Value>, output: Vec<Value>, parent: Option<Arc<Turn>>) -> Self {
        let own: usize = input.iter().chain(&output).map(json_len).sum();
        let (depth, before) = parent.as_ref().map_or((0, 0), |p| (p.depth, p.chain_bytes));
        Self {
            input,
            output,
            parent,
            depth: depth + 1,
            chain_bytes: before.saturating_add(own),
            journal_id: OnceLock::new(),
        }
    }

    /// Turns in the conversation up to and including this one.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The conversation's items, oldest first: each turn's input, then its output.
    pub fn items(&self) -> Vec<Value> {
        let mut turns = Vec::with_capacity(self.depth);
        let mut at = Some(self);
        while let Some(turn) = at {
            turns.push(turn);
            at = turn.parent.as_deref();
        }
        turns
            .iter()
            .rev()
            .flat_map(|t| t.input.iter().chain(&t.output))
            .cloned()
            .collect()
    }
}

impl Drop for Turn {
    /// Unlinks the chain iteratively: a long conversation dropped at once must not recurse
    /// once per turn.
    fn drop(&mut self) {
        let mut parent = self.parent.take();
        while let Some(p) = parent {
            match Arc::try_unwrap(p) {
                Ok(mut turn) => parent = turn.parent.take(),
                Err(_) => break,
            }
        }
    }
}

/// Serialized size of `v`.
fn json_len(v: &Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

/// A stored response as read back.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object as it was sent (the final one, for a stream).
    pub response: Value,
    /// Its conversation.
    pub turn: Arc<Turn>,
    /// Its events, for a background response created with `stream` (see [`events`]).
    pub events: Option<Arc<EventLog>>,
}

/// Whether [`ResponseStore::insert`] kept the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Stored.
    Yes,
    /// Storing is off.
    Disabled,
    /// Larger than the byte bound alone.
    TooLarge,
}

/// A stored response's key: its tenant and its id. Ids are the tenant's own (a client's
/// `X-Request-Id` names its response), so one tenant's id never touches another's response.
type Key = (String, String);

fn key(tenant: &str, id: &str) -> Key {
    (tenant.to_owned(), id.to_owned())
}

struct Entry {
    stored: StoredResponse,
    /// What it counts against the byte bound, its events' included.
    bytes: usize,
    /// Of which its events'.
    event_bytes: usize,
    at: Instant,
    /// When it was stored, in milliseconds since the Unix epoch (the journal's clock).
    at_ms: u64,
    /// Its key in the recency order.
    tick: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// Recency: the least recently used first.
    order: BTreeMap<u64, Key>,
    next_tick: u64,
    /// What the stored responses count, their events' included.
    bytes: usize,
    /// Of which the stored responses' events' (not journaled).
    event_bytes: usize,
    /// What the events of running background responses count ([`events`]).
    live_bytes: usize,
}

impl Inner {
    fn touch(&mut self, key: &Key) {
        let tick = self.next_tick;
        if let Some(e) = self.entries.get_mut(key) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, key.clone());
            self.next_tick += 1;
        }
    }

    fn remove(&mut self, key: &Key) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.order.remove(&e.tick);
        self.bytes -= e.bytes;
        self.event_bytes -= e.event_bytes;
        Some(e)
    }

    fn publish(&self) {
        metrics::gauge!(RESPONSES_STORED).set(self.entries.len() as f64);
        metrics::gauge!(RESPONSES_STORED_BYTES).set((self.bytes + self.live_bytes) as f64);
    }
}

/// Whether `response` is still running (`queued` or `in_progress`): not journaled, as after a
/// restart it would never end.
fn running(response: &Value) -> bool {
    matches!(response["status"].as_str(), Some("queued" | "in_progress"))
}

/// The `reason` label's values of `responses_evicted_total`: the store's three bounds.
const EVICTION_REASONS: [&str; 3] = ["count", "bytes", "age"];

/// A background response running: which run it is, and what aborts it.
struct Running {
    run: u64,
    abort: AbortHandle,
}

/// A stored foreground response's claim on its name, given back when dropped.
pub struct ForegroundName {
    store: Arc<ResponseStore>,
    key: Key,
}

impl Drop for ForegroundName {
    fn drop(&mut self) {
        let mut foreground = self.store.foreground.lock();
        if let Some(n) = foreground.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                foreground.remove(&self.key);
            }
        }
    }
}

/// The bounded, tenant-scoped store of responses, and the background responses running now.
pub struct ResponseStore {
    /// Where changes are journaled, with a directory. Declared first so that it drops first:
    /// its writer finishes (rewriting the log from `inner` if a record was dropped) while the
    /// store is still there.
    journal: Option<journal::Journal>,
    limits: StoreLimits,
    /// The responses; shared only with the journal's writer, which reads it to rewrite the log.
    inner: Arc<Mutex<Inner>>,
    running: Mutex<HashMap<Key, Running>>,
    /// Stored foreground responses in flight, by name: how many (locked after `running`).
    foreground: Mutex<HashMap<Key, usize>>,
    next_run: AtomicU64,
}

impl std::fmt::Debug for ResponseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("ResponseStore")
            .field("limits", &self.limits)
            .field("responses", &inner.entries.len())
            .field("bytes", &inner.bytes)
            .finish()
    }
}

impl ResponseStore {
    /// An empty store bounded by `limits`. Its series exist from here on, at zero
    /// (`responses_evicted_total` of each reason was missing until its first eviction).
    pub fn new(limits: StoreLimits) -> Self {
        for reason in EVICTION_REASONS {
            metrics::counter!(RESPONSES_EVICTED, "reason" => reason).increment(0);
        }
        let store = Self {
            limits,
            inner: Arc::new(Mutex::new(Inner::default())),
            running: Mutex::new(HashMap::new()),
            foreground: Mutex::new(HashMap::new()),
            next_run: AtomicU64::new(0),
            journal: None,
        };
        store.inner.lock().publish();
        store
    }

    /// A store bounded by `limits`, journaled in `dir` when given (see [`journal`]): what the
    /// directory's log holds is loaded within the bounds, and the directory is locked against
    /// another server for as long as the store lives.
    pub fn open(limits: StoreLimits, dir: Option<&Path>) -> Result<Self, JournalError> {
        metrics::counter!(RESPONSES_JOURNAL_ERRORS).increment(0);
        let mut store = Self::new(limits);
        if let Some(dir) = dir {
            journal::open(dir, &mut store)?;
        }
        Ok(store)
    }

    /// Blocks until every change so far is in the journal and synced (at once without one); a
    /// log that missed a dropped record is rewritten from the store first.
    pub fn sync(&self) {
        if let Some(journal) = &self.journal {
            journal.sync();
        }
    }

    /// Journals the removal of `key` (deleted, evicted or expired).
    fn journal_delete(&self, key: &Key) {
        if let Some(journal) = &self.journal {
            journal.offer(
                journal::Op::Delete {
                    tenant: key.0.clone(),
                    id: key.1.clone(),
                },
                0,
            );
        }
    }

    /// Asks the journal's writer to compact its log when dead records outweigh the live ones.
    fn maybe_compact(&self, inner: &Inner) {
        if let Some(journal) = &self.journal {
            if journal.wants_compaction(inner.bytes - inner.event_bytes) {
                journal.compact(journal::snapshot(inner));
            }
        }
    }

    /// Its bounds.
    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    /// Keeps `response` (its object, its conversation) under `id` for `tenant`, replacing what
    /// the tenant's `id` held, and lets the least recently used responses go while a bound is
    /// passed.
    pub fn insert(&self, id: &str, tenant: &str, response: Value, turn: Arc<Turn>) -> Kept {
        self.insert_with_events(id, tenant, response, turn, None)
    }

    /// [`ResponseStore::insert`] with the response's events: an ended log counts in the
    /// entry's bytes from here on (no longer among the running logs'), a running one is only
    /// referred to. An entry too large with its events is kept without them.
    pub fn insert_with_events(
        &self,
        id: &str,
        tenant: &str,
        response: Value,
        turn: Arc<Turn>,
        events: Option<Arc<EventLog>>,
    ) -> Kept {
        self.insert_entry(
            id,
            tenant,
            StoredResponse {
                response,
                turn,
                events,
            },
            Instant::now(),
            journal::unix_ms(),
        )
    }

    fn insert_at(
        &self,
        id: &str,
        tenant: &str,
        response: Value,
        turn: Arc<Turn>,
        now: Instant,
        now_ms: u64,
    ) -> Kept {
        let stored = StoredResponse {
            response,
            turn,
            events: None,
        };
        self.insert_entry(id, tenant, stored, now, now_ms)
    }

    fn insert_entry(
        &self,
        id: &str,
        tenant: &str,
        mut stored: StoredResponse,
        now: Instant,
        now_ms: u64,
    ) -> Kept {
        if !self.limits.enabled() {
            self.release_ended(stored.events.as_deref());
            return Kept::Disabled;
        }
        let bytes = json_len(&stored.response)
            .saturating_add(stored.turn.chain_bytes)
            .saturating_add(id.len() + tenant.len());
        if bytes > self.limits.max_bytes {
            self.release_ended(stored.events.as_deref());
            return Kept::TooLarge;
        }
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        let mut event_bytes = match &stored.events {
            Some(log) => events::move_into_entry(&mut inner.live_bytes, log),
            None => 0,
        };
        if bytes.saturating_add(event_bytes) > self.limits.max_bytes {
            // Kept without its events (`move_into_entry` stopped counting them as running).
            stored.events = None;
            event_bytes = 0;
        }
        let bytes = bytes + event_bytes;
        let (response, turn) = (&stored.response, &stored.turn);
        let replaced = inner.remove(&key);
        self.expire(&mut inner, now);
        while inner.entries.len() >= self.limits.max_responses
            || inner.bytes + inner.live_bytes + bytes > self.limits.max_bytes
        {
            let reason = if inner.entries.len() >= self.limits.max_responses {
                "count"
            } else {
                "bytes"
            };
            let Some((_, oldest)) = inner.order.first_key_value() else {
                break;
            };
            let oldest = oldest.clone();
            inner.remove(&oldest);
            self.journal_delete(&oldest);
            metrics::counter!(RESPONSES_EVICTED, "reason" => reason).increment(1);
        }
        if let Some(journal) = &self.journal {
            // A response still running is not journaled: after a restart it would never end.
            // Its name's earlier response, replaced in memory, is deleted from the log if the
            // log holds it (not if it was running too: a background response's `queued` and
            // `in_progress` states write nothing, and its end one put).
            if running(response) {
                if replaced.is_some_and(|e| !running(&e.stored.response)) {
                    self.journal_delete(&key);
                }
            } else {
                let put = journal::PutOp {
                    tenant: tenant.to_owned(),
                    id: id.to_owned(),
                    at_ms: now_ms,
                    response: response.clone(),
                    turn: Arc::clone(turn),
                };
                // What the queued record keeps alive: its object and, should the store let the
                // response go meanwhile, its conversation (not its events).
                journal.offer(journal::Op::Put(put), bytes - event_bytes);
            }
        }
        let tick = inner.next_tick;
        inner.next_tick += 1;
        inner.order.insert(tick, key.clone());
        inner.bytes += bytes;
        inner.event_bytes += event_bytes;
        inner.entries.insert(
            key,
            Entry {
                stored,
                bytes,
                event_bytes,
                at: now,
                at_ms: now_ms,
                tick,
            },
        );
        inner.publish();
        self.maybe_compact(&inner);
        Kept::Yes
    }

    /// Stops counting the events of an entry not kept, once they have ended. A log still
    /// running (the `queued` entry of a background response) is left to its task, which
    /// appends to it and releases it when it ends: ending it here would leave its stream
    /// without a single event.
    fn release_ended(&self, events: Option<&EventLog>) {
        if let Some(log) = events.filter(|log| log.has_ended()) {
            self.release_events(log);
        }
    }

    /// Lets responses past the age limit go, least recently used first, while the least
    /// recently used one is past it (the rest go when read, or as the bounds push them out).
    fn expire(&self, inner: &mut Inner, now: Instant) {
        let Some(max_age) = self.limits.max_age else {
            return;
        };
        while let Some((_, key)) = inner.order.first_key_value() {
            let expired = inner
                .entries
                .get(key)
                .is_some_and(|e| now.saturating_duration_since(e.at) > max_age);
            if !expired {
                break;
            }
            let key = key.clone();
            inner.remove(&key);
            self.journal_delete(&key);
            metrics::counter!(RESPONSES_EVICTED, "reason" => "age").increment(1);
        }
    }

    /// The response `id` of `tenant`, if kept (and not past the age limit); it becomes the
    /// most recently used.
    pub fn get(&self, tenant: &str, id: &str) -> Option<StoredResponse> {
        self.get_at(tenant, id, Instant::now())
    }

    fn get_at(&self, tenant: &str, id: &str, now: Instant) -> Option<StoredResponse> {
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        let entry = inner.entries.get(&key)?;
        if self
            .limits
            .max_age
            .is_some_and(|max| now.saturating_duration_since(entry.at) > max)
        {
            inner.remove(&key);
            self.journal_delete(&key);
            metrics::counter!(RESPONSES_EVICTED, "reason" => "age").increment(1);
            inner.publish();
            return None;
        }
        let stored = entry.stored.clone();
        let latest = entry.tick + 1 == inner.next_tick;
        let running = matches!(
            stored.response["status"].as_str(),
            Some("queued" | "in_progress")
        );
        inner.touch(&key);
        // The journal follows the recency order (not for one already the most recent, as a
        // poll of one response reads it again and again, nor for one still running, which is
        // not in the log): a restart's first eviction leaves the response read here alone.
        if let Some(journal) = self.journal.as_ref().filter(|_| !latest && !running) {
            journal.offer(
                journal::Op::Touch {
                    tenant: key.0.clone(),
                    id: key.1.clone(),
                },
                0,
            );
            self.maybe_compact(&inner);
        }
        Some(stored)
    }

    /// Deletes the response `id` of `tenant`; whether there was one.
    pub fn remove(&self, tenant: &str, id: &str) -> bool {
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        let removed = inner.remove(&key).is_some();
        if removed {
            self.journal_delete(&key);
            self.maybe_compact(&inner);
        }
        inner.publish();
        removed
    }

    /// Registers background response `id` of `tenant` as running, `abort` ending it: the run's
    /// number for [`ResponseStore::finish_background`], or `None` when one of that id is
    /// running already (the caller drops its own).
    pub fn start_background(&self, tenant: &str, id: &str, abort: AbortHandle) -> Option<u64> {
        let mut running = self.running.lock();
        let key = key(tenant, id);
        if self.foreground.lock().contains_key(&key) {
            return None;
        }
        let entry = running.entry(key);
        if matches!(entry, Entry_::Occupied(_)) {
            return None;
        }
        let run = self.next_run.fetch_add(1, Ordering::Relaxed);
        entry.or_insert(Running { run, abort });
        Some(run)
    }

    /// Claims the name `id` of `tenant` for a stored foreground response until the claim drops,
    /// or `None` while a background response of that name runs: either would replace the
    /// other's entry and then be replaced by it. Foreground responses may share a name (the
    /// last to end is kept), and no background response takes a claimed one.
    pub fn claim_foreground(self: &Arc<Self>, tenant: &str, id: &str) -> Option<ForegroundName> {
        let running = self.running.lock();
        let key = key(tenant, id);
        if running.contains_key(&key) {
            return None;
        }
        *self.foreground.lock().entry(key.clone()).or_insert(0) += 1;
        Some(ForegroundName {
            store: Arc::clone(self),
            key,
        })
    }

    /// Background run `run` of response `id` ended by itself: whether it was still registered
    /// (false: it was cancelled meanwhile, and its end is not to be stored).
    pub fn finish_background(&self, tenant: &str, id: &str, run: u64) -> bool {
        let mut running = self.running.lock();
        let key = key(tenant, id);
        if running.get(&key).is_some_and(|r| r.run == run) {
            running.remove(&key);
            return true;
        }
        false
    }

    /// Cancels background response `id` of `tenant` if it is running: whether it was (its task
    /// stores nothing more; the caller stores the cancelled response).
    pub fn cancel_background(&self, tenant: &str, id: &str) -> bool {
        match self.running.lock().remove(&key(tenant, id)) {
            Some(r) => {
                r.abort.abort();
                true
            }
            None => false,
        }
    }

    /// Responses kept now.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes counted now.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn a_background_response_is_cancelled_once_and_only_by_its_tenant() {
        let s = store(10, 1 << 20, None);
        let (abort, registration) = AbortHandle::new_pair();
        let task = futures_util::future::Abortable::new(std::future::pending::<()>(), registration);
        let run = s
            .start_background("alice", "r1", abort)
            .expect("registered");
        // The same id runs once per tenant at a time; another tenant's is its own.
        let (other, _r) = AbortHandle::new_pair();
        assert_eq!(s.start_background("alice", "r1", other.clone()), None);
        let bobs = s.start_background("bob", "r1", other).expect("bob's own");
        assert!(!task.is_aborted());
        assert!(s.cancel_background("alice", "r1"));
        assert!(task.is_aborted());
        // Its task learns that it was cancelled; a second cancel finds nothing running.
        assert!(!s.finish_background("alice", "r1", run));
        assert!(!s.cancel_background("alice", "r1"));
        // Bob's run is untouched, and ends by itself.
        assert!(s.finish_background("bob", "r1", bobs));
        assert!(!s.cancel_background("bob", "r1"));
    }

    /// A name is a background response's or stored foreground responses' at a time: each would
    /// replace the other's entry, then be replaced by the other's end. Foreground ones share.
    #[test]
    fn a_name_is_background_or_foreground_at_a_time() {
        let s = Arc::new(store(10, 1 << 20, None));
        let first = s.claim_foreground("alice", "r1").expect("free");
        let second = s.claim_foreground("alice", "r1").expect("shared");
        let (abort, _r) = AbortHandle::new_pair();
        assert_eq!(s.start_background("alice", "r1", abort.clone()), None);
        let bobs = s
            .start_background("bob", "r1", abort.clone())
            .expect("bob's own");
        assert!(s.claim_foreground("bob", "r1").is_none());
        drop(first);
        assert_eq!(s.start_background("alice", "r1", abort.clone()), None);
        drop(second);
        let run = s
            .start_background("alice", "r1", abort)
            .expect("free again");
        assert!(s.claim_foreground("alice", "r1").is_none());
        assert!(s.finish_background("alice", "r1", run));
        assert!(s.finish_background("bob", "r1", bobs));
        assert!(s.claim_foreground("alice", "r1").is_some());
        assert!(s.foreground.lock().is_empty());
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
}
