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
//! runs, once stored, and (not kept) while live readers still read them; never journaled.
//!
//! A background response still running is never evicted: its `queued` entry stays out of the
//! recency order until its end replaces it (or a cancel or DELETE ends it), so the bounds let
//! finished responses go for it, and its own growing events drop their oldest rather than
//! evict it. The running ones alone may pass the bounds: each holds a request the engine runs.
//! What happens to a background response is decided under the store's one lock, in one order:
//! its start (registered and stored `queued` at once), its end stored by its task (only while
//! it is still registered), a cancel (unregistered, its events ended and the response stored
//! `cancelled` at once) and a DELETE (unregistered and removed at once). So a DELETE answered
//! 200 stays deleted, and a cancel answered 200 stays `cancelled`. A stream's look at a
//! response takes its events under the same lock ([`ResponseStore::get_for_stream`]), so a
//! DELETE is before it or after it, never between. Running responses are bounded apart from
//! the store: each holds an engine request, so `server.max_pending_requests` bounds them.
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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::AbortHandle;
use parking_lot::Mutex;
use serde_json::Value;

use crate::metrics::{
    RESPONSES_EVICTED, RESPONSES_JOURNAL_ERRORS, RESPONSES_STORED, RESPONSES_STORED_BYTES,
};

pub mod events;
pub mod journal;

pub use events::{EventLog, Gone, Read, ReaderHold};
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

/// What [`ResponseStore::cancel_background`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Cancel {
    /// It was running: it is stored `cancelled`, as this object says.
    Cancelled(Value),
    /// No background response of that id runs with a stored entry (it has ended, or never
    /// was): nothing changed.
    NotRunning,
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
    /// Its key in the recency order; `None` for a background response still running, which
    /// is out of it (never evicted nor expired).
    tick: Option<u64>,
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
    /// What the events of running background responses count ([`events`]), and those of
    /// the logs kept for their readers.
    live_bytes: usize,
    /// The logs of responses not kept (their end too large) still read by live readers,
    /// counted in `live_bytes` until the last reader lets go, oldest first ([`events`]).
    for_readers: BTreeMap<u64, Arc<EventLog>>,
    next_for_readers: u64,
    /// The background responses running now.
    running: HashMap<Key, Running>,
}

impl Inner {
    fn touch(&mut self, key: &Key) {
        let tick = self.next_tick;
        if let Some(e) = self.entries.get_mut(key) {
            let Some(old) = e.tick else {
                return;
            };
            self.order.remove(&old);
            e.tick = Some(tick);
            self.order.insert(tick, key.clone());
            self.next_tick += 1;
        }
    }

    /// Takes `key`'s entry out, its events with it (they stay readable only where the caller
    /// stores them again).
    fn take(&mut self, key: &Key) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        if let Some(tick) = e.tick {
            self.order.remove(&tick);
        }
        self.bytes -= e.bytes;
        self.event_bytes -= e.event_bytes;
        Some(e)
    }

    /// Removes `key`'s entry, `gone` as it says why: its events are dropped at once, and their
    /// readers end with the `error` event that says so ([`events::Gone`]).
    fn remove(&mut self, key: &Key, gone: Gone) -> bool {
        let Some(e) = self.take(key) else {
            return false;
        };
        if let Some(log) = &e.stored.events {
            events::close(self, log, gone);
        }
        true
    }

    fn publish(&self) {
        metrics::gauge!(RESPONSES_STORED).set(self.entries.len() as f64);
        metrics::gauge!(RESPONSES_STORED_BYTES).set((self.bytes + self.live_bytes) as f64);
    }
}

/// What an entry counts against the byte bound without its events.
fn entry_bytes(id: &str, tenant: &str, stored: &StoredResponse) -> usize {
    json_len(&stored.response)
        .saturating_add(stored.turn.chain_bytes)
        .saturating_add(id.len() + tenant.len())
}

/// Releases the events of an entry not kept, once they have ended ([`events::release`]: they
/// count on while readers hold them). A log still running (the `queued` entry of a background
/// response) is left to its task, which appends to it and releases it when it ends: ending it
/// here would leave its stream without a single event.
fn release_ended(inner: &mut Inner, events: Option<&Arc<EventLog>>) {
    if let Some(log) = events.filter(|log| log.has_ended()) {
        events::release(inner, log);
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
    /// The responses and the background ones running; shared only with the journal's writer,
    /// which reads it to rewrite the log.
    inner: Arc<Mutex<Inner>>,
    /// Stored foreground responses in flight, by name: how many (locked after `inner`).
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
        stored: StoredResponse,
        now: Instant,
        now_ms: u64,
    ) -> Kept {
        let bytes = entry_bytes(id, tenant, &stored);
        let mut inner = self.inner.lock();
        let kept = self.insert_locked(&mut inner, key(tenant, id), stored, bytes, (now, now_ms));
        inner.publish();
        kept
    }

    /// [`ResponseStore::insert_entry`] under the lock: `bytes` is what the entry counts without
    /// its events ([`entry_bytes`]), `at` when it is stored (both clocks). An entry whose key
    /// is a running background response's, or whose events are still being written, stays out
    /// of the recency order (never evicted) until an entry that ends replaces it.
    fn insert_locked(
        &self,
        inner: &mut Inner,
        key: Key,
        mut stored: StoredResponse,
        bytes: usize,
        (now, now_ms): (Instant, u64),
    ) -> Kept {
        if !self.limits.enabled() {
            release_ended(inner, stored.events.as_ref());
            return Kept::Disabled;
        }
        if bytes > self.limits.max_bytes {
            release_ended(inner, stored.events.as_ref());
            return Kept::TooLarge;
        }
        let given = stored.events.clone();
        let ended = stored.events.as_deref().map_or(0, events::ended_bytes);
        let event_bytes = if bytes.saturating_add(ended) > self.limits.max_bytes {
            // Kept without its events, which have ended: released, their live readers read
            // them to their end, counted meanwhile.
            if let Some(log) = stored.events.take() {
                events::release(inner, &log);
            }
            0
        } else {
            match &stored.events {
                Some(log) => events::move_into_entry(&mut inner.live_bytes, log),
                None => 0,
            }
        };
        let bytes = bytes + event_bytes;
        let replaced = inner.take(&key);
        if let Some(log) = replaced.as_ref().and_then(|e| e.stored.events.as_ref()) {
            // The entry replaced by its own end (or cancel) hands its events on; another
            // response's events leave with it.
            if !given.as_ref().is_some_and(|g| Arc::ptr_eq(g, log)) {
                events::close(inner, log, Gone::Replaced);
            }
        }
        self.expire(inner, now);
        while inner.entries.len() >= self.limits.max_responses
            || inner.bytes + inner.live_bytes + bytes > self.limits.max_bytes
        {
            let reason = if inner.entries.len() >= self.limits.max_responses {
                "count"
            } else {
                "bytes"
            };
            // Only finished responses leave: running ones are out of the order, and the logs
            // counted for running responses or for their readers stay (they make room only
            // for a growing log, [`ResponseStore::record_events`]).
            let Some((_, oldest)) = inner.order.first_key_value() else {
                break;
            };
            let oldest = oldest.clone();
            inner.remove(&oldest, Gone::Evicted);
            self.journal_delete(&oldest);
            metrics::counter!(RESPONSES_EVICTED, "reason" => reason).increment(1);
        }
        let (response, turn) = (&stored.response, &stored.turn);
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
                    tenant: key.0.clone(),
                    id: key.1.clone(),
                    at_ms: now_ms,
                    response: response.clone(),
                    turn: Arc::clone(turn),
                };
                // What the queued record keeps alive: its object and, should the store let the
                // response go meanwhile, its conversation (not its events).
                journal.offer(journal::Op::Put(put), bytes - event_bytes);
            }
        }
        // A running response stays out of the order: registered, or holding events still
        // written (so a log appended to is never an evictable entry's).
        let runs = inner.running.contains_key(&key)
            || stored.events.as_ref().is_some_and(|log| !log.has_ended());
        let tick = (!runs).then(|| {
            let tick = inner.next_tick;
            inner.next_tick += 1;
            inner.order.insert(tick, key.clone());
            tick
        });
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
        self.maybe_compact(inner);
        Kept::Yes
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
            inner.remove(&key, Gone::Evicted);
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
        self.get_with(tenant, id, now, |_, _| ())
            .map(|(stored, ())| stored)
    }

    /// [`ResponseStore::get`] for a stream of the response's events
    /// (`GET /v1/responses/{id}?stream=true`): the response and, where it keeps events, a
    /// reader's hold on them and the sequence number of the oldest one kept, all taken under
    /// the store's lock at once. So a DELETE (or any other end of the entry) comes either
    /// before (`None`: a 404) or after (the stream's reader finds the events gone and ends
    /// with the `error` event saying why), never between the look and the stream's start.
    pub fn get_for_stream(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
    ) -> Option<(StoredResponse, Option<(u64, ReaderHold)>)> {
        self.get_with(tenant, id, Instant::now(), |inner, stored| {
            stored.events.as_ref().map(|log| {
                let hold = self.hold_locked(inner, log);
                (log.span().0, hold)
            })
        })
    }

    /// [`ResponseStore::get_at`], with what `with` reads of the response under the same lock.
    fn get_with<R>(
        &self,
        tenant: &str,
        id: &str,
        now: Instant,
        with: impl FnOnce(&mut Inner, &StoredResponse) -> R,
    ) -> Option<(StoredResponse, R)> {
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        let entry = inner.entries.get(&key)?;
        // A background response still running does not expire (its end is stored anew).
        if entry.tick.is_some()
            && self
                .limits
                .max_age
                .is_some_and(|max| now.saturating_duration_since(entry.at) > max)
        {
            inner.remove(&key, Gone::Evicted);
            self.journal_delete(&key);
            metrics::counter!(RESPONSES_EVICTED, "reason" => "age").increment(1);
            inner.publish();
            return None;
        }
        let stored = entry.stored.clone();
        let latest = entry.tick.is_some_and(|t| t + 1 == inner.next_tick);
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
        let also = with(&mut inner, &stored);
        Some((stored, also))
    }

    /// Deletes the response `id` of `tenant`; whether there was one. A background response
    /// still running is aborted and unregistered at once, so its task stores nothing more; the
    /// readers of its events end with a `response_deleted` `error` event.
    pub fn remove(&self, tenant: &str, id: &str) -> bool {
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        if let Some(r) = inner.running.remove(&key) {
            r.abort.abort();
        }
        let removed = inner.remove(&key, Gone::Deleted);
        if removed {
            self.journal_delete(&key);
            self.maybe_compact(&inner);
        }
        inner.publish();
        removed
    }

    /// Registers background response `id` of `tenant` as running, `abort` ending it, and
    /// stores `queued` (its object as it starts, its events if it streams) at once: the run's
    /// number for [`ResponseStore::finish_background`] and whether the entry was kept, or
    /// `None` when a response of that name runs already, background or stored foreground
    /// (the caller drops its own). A `queued` entry too large to keep leaves its events
    /// running (its task writes and releases them).
    pub fn start_background(
        &self,
        tenant: &str,
        id: &str,
        abort: AbortHandle,
        queued: StoredResponse,
    ) -> Option<(u64, Kept)> {
        let bytes = entry_bytes(id, tenant, &queued);
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        if inner.running.contains_key(&key) || self.foreground.lock().contains_key(&key) {
            return None;
        }
        let run = self.next_run.fetch_add(1, Ordering::Relaxed);
        inner.running.insert(key.clone(), Running { run, abort });
        let now = (Instant::now(), journal::unix_ms());
        let kept = self.insert_locked(&mut inner, key, queued, bytes, now);
        inner.publish();
        Some((run, kept))
    }

    /// Claims the name `id` of `tenant` for a stored foreground response until the claim drops,
    /// or `None` while a background response of that name runs: either would replace the
    /// other's entry and then be replaced by it. Foreground responses may share a name (the
    /// last to end is kept), and no background response takes a claimed one.
    pub fn claim_foreground(self: &Arc<Self>, tenant: &str, id: &str) -> Option<ForegroundName> {
        let inner = self.inner.lock();
        let key = key(tenant, id);
        if inner.running.contains_key(&key) {
            return None;
        }
        *self.foreground.lock().entry(key.clone()).or_insert(0) += 1;
        Some(ForegroundName {
            store: Arc::clone(self),
            key,
        })
    }

    /// Background run `run` of response `id` ended by itself: if it is still registered (not
    /// cancelled nor deleted meanwhile), it is unregistered, `last` (its last events: its end,
    /// or its error) ends its events, and `end` is stored, all at once, and whether `end` was
    /// kept is returned; otherwise `None`, and nothing is written. An end too large to keep
    /// takes its `queued` entry with it: the response is not kept.
    pub fn finish_background(
        &self,
        tenant: &str,
        id: &str,
        run: u64,
        last: Vec<Bytes>,
        end: StoredResponse,
    ) -> Option<Kept> {
        let bytes = entry_bytes(id, tenant, &end);
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        if inner.running.get(&key).is_none_or(|r| r.run != run) {
            return None;
        }
        inner.running.remove(&key);
        if let Some(log) = &end.events {
            let mut state = log.lock();
            if !state.ended {
                self.append(&mut inner, &mut state, last, true);
            }
            drop(state);
            log.wake();
        }
        let now = (Instant::now(), journal::unix_ms());
        let kept = self.insert_locked(&mut inner, key.clone(), end, bytes, now);
        if kept != Kept::Yes {
            // Its `queued` entry is no longer what runs: it leaves, its events' readers
            // reading them to their end.
            inner.take(&key);
        }
        inner.publish();
        Some(kept)
    }

    /// Cancels background response `id` of `tenant` if it runs with a stored entry: it is
    /// aborted and unregistered, its events end with the event `cancelled` writes for their
    /// next sequence number, and its entry is stored `cancelled`, all at once.
    pub fn cancel_background(
        &self,
        tenant: &str,
        id: &str,
        cancelled: impl FnOnce(u64) -> Bytes,
    ) -> Cancel {
        let key = key(tenant, id);
        let mut inner = self.inner.lock();
        if !inner.running.contains_key(&key) {
            return Cancel::NotRunning;
        }
        let Some(entry) = inner.entries.get(&key) else {
            // Its `queued` entry was too large to keep: there is nothing to cancel by id.
            return Cancel::NotRunning;
        };
        let mut stored = entry.stored.clone();
        if let Some(r) = inner.running.remove(&key) {
            r.abort.abort();
        }
        if let Some(log) = &stored.events {
            let mut state = log.lock();
            if !state.ended {
                let frame = cancelled(state.end());
                self.append(&mut inner, &mut state, vec![frame], true);
            }
            drop(state);
            log.wake();
        }
        stored.response["status"] = Value::from("cancelled");
        let response = stored.response.clone();
        let bytes = entry_bytes(id, tenant, &stored);
        let now = (Instant::now(), journal::unix_ms());
        if self.insert_locked(&mut inner, key.clone(), stored, bytes, now) != Kept::Yes {
            inner.take(&key);
        }
        inner.publish();
        Cancel::Cancelled(response)
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
mod tests;
