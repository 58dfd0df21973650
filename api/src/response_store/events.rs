//! The events of background responses created with `stream: true`, kept so that
//! `GET /v1/responses/{id}?stream=true&starting_after=N` can replay them and follow the live
//! ones (OpenAI's resumable streams).
//!
//! An [`EventLog`] holds one response's SSE frames, each one event, in sequence-number order
//! from its `first` kept one. Its task appends as the response runs ([`ResponseStore::record_events`]);
//! readers hold a cursor (the next sequence number) and are woken on each change, so a slow
//! reader costs no memory of its own: it reads the shared frames at its pace.
//!
//! Memory is bounded twice, both against the store's byte bound (`server.responses.max_stored_mb`):
//! - one response keeps at most [`StoreLimits::max_event_bytes`] of events (an eighth of the
//!   bound), its oldest events leaving first; a resume from before the oldest kept event is
//!   refused, and a reader that fell that far behind is cut off with an `error` event;
//! - the events of running responses count with the stored responses against the bound: the
//!   least recently used stored responses leave to make room, then the growing log's own oldest
//!   events (one event always stays, so a log may pass its bound by its last event). Once the
//!   response has ended its events move into its stored entry, counted in its bytes, and leave
//!   with it (evicted, expired or deleted); an ended response is stored even where the running
//!   logs leave less room than it takes, so the total may pass the bound by that one response.
//!   A running response's own `queued` entry never leaves for its events: it is out of the
//!   store's recency order until it ends.
//!
//! A log lives only as long as the store keeps it: when its response leaves the store
//! (deleted, evicted, expired, or replaced by another response of its name) its events are
//! dropped at once, and each reader still reading them ends with an `error` event saying why
//! ([`Gone`]), numbered as the event it would have read next. So no reader keeps events alive
//! that the store no longer counts.
//!
//! A response whose end is too large to keep with its events, or at all, leaves no entry to
//! hold them; its streams following it live still read them to their end (the end event holds
//! the only copy of the response those clients will get), and the events count against the
//! byte bound meanwhile: each reader holds the log ([`ReaderHold`]), and a log released with
//! readers (its task ended, no entry took it) stays among the counted logs, kept for its
//! readers (`Inner::for_readers`), until the last one lets go. Such logs make room for a
//! growing running log after the stored responses (oldest first; their readers end with
//! `response_evicted`) and before its own oldest events, so they never pass the bound between
//! them; a stored response does not evict them (the store may pass its bound by that one
//! response, as it may for running logs). A log released without readers stops counting at
//! once.
//!
//! One response's share of the bound, an eighth, is fixed rather than a setting: the byte
//! bound is the one memory setting an operator sets (a share of their own would only let one
//! response starve the others, or shrink every resume window with no gain in memory), the
//! default's 32 MiB holds the events of well over 100,000 output tokens (an
//! `output_text.delta` event is about 200 bytes), more than any context window served, and a
//! longer resume window comes with a larger `max_stored_mb`.
//!
//! Logs are in memory only: the journal keeps the ended response, not its events, so after a
//! restart a stored response can be read back but not streamed.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{Inner, ResponseStore, StoreLimits, RESPONSES_EVICTED};

/// A reader's hold on a log ([`ResponseStore::hold_events`]): while any reader holds a log
/// that no task writes and no stored entry took (its response's end was too large to keep),
/// its bytes still count against the store's byte bound. Dropping the last hold stops that.
pub struct ReaderHold {
    store: Arc<ResponseStore>,
    log: Arc<EventLog>,
}

impl ReaderHold {
    /// The log held.
    pub fn log(&self) -> &Arc<EventLog> {
        &self.log
    }
}

impl std::fmt::Debug for ReaderHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReaderHold").field(&self.log).finish()
    }
}

impl Drop for ReaderHold {
    fn drop(&mut self) {
        let mut inner = self.store.inner.lock();
        let mut state = self.log.lock();
        state.readers = state.readers.saturating_sub(1);
        if state.readers == 0 {
            if let Some(key) = state.for_readers.take() {
                inner.for_readers.remove(&key);
                stop_counting(&mut inner.live_bytes, &mut state);
            }
        }
        drop(state);
        inner.publish();
    }
}

/// One response's kept events (see the module docs).
pub struct EventLog {
    state: Mutex<LogState>,
    /// Bumped on every change, to wake the readers.
    changed: watch::Sender<()>,
}

#[derive(Debug, Default)]
pub(super) struct LogState {
    frames: VecDeque<Bytes>,
    /// The sequence number of `frames[0]`.
    first: u64,
    /// The frames' bytes.
    bytes: usize,
    /// Its last event is in: nothing more is appended.
    pub(super) ended: bool,
    /// Its response left the store, and its events with it.
    gone: Option<Gone>,
    /// Its bytes count among the store's running logs' ([`super::Inner::live_bytes`]): until
    /// it moves into a stored entry, or is released with no reader left.
    live: bool,
    /// Its bytes count in a stored entry's (it moved into one, [`move_into_entry`]).
    in_entry: bool,
    /// The readers holding it now ([`ReaderHold`]).
    readers: usize,
    /// Its key among the store's logs kept for their readers alone
    /// ([`super::Inner::for_readers`]): released by its task, taken by no entry, and still read.
    for_readers: Option<u64>,
}

impl LogState {
    /// The sequence number the next event would take.
    pub(super) fn end(&self) -> u64 {
        self.first + self.frames.len() as u64
    }

    /// Drops the oldest frame: the bytes it freed.
    fn pop(&mut self) -> usize {
        let Some(frame) = self.frames.pop_front() else {
            return 0;
        };
        self.first += 1;
        self.bytes -= frame.len();
        frame.len()
    }
}

/// What a reader at a sequence number finds ([`EventLog::read`]).
#[derive(Debug, PartialEq)]
pub enum Read {
    /// The next events, and the sequence number after them.
    Frames(Vec<Bytes>, u64),
    /// Nothing yet: wait for a change ([`EventLog::subscribe`]).
    Wait,
    /// Nothing more: the log has ended.
    Ended,
    /// The events from the reader's on are no longer kept: the oldest kept one is this.
    Behind(u64),
    /// The response left the store, and its events with it.
    Gone(Gone),
}

/// Why a response's events were dropped while readers may still read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// `DELETE /v1/responses/{id}`.
    Deleted,
    /// The store's bounds let it go (count, bytes or age).
    Evicted,
    /// Another response of its name replaced it.
    Replaced,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock();
        f.debug_struct("EventLog")
            .field("first", &state.first)
            .field("events", &state.frames.len())
            .field("bytes", &state.bytes)
            .field("ended", &state.ended)
            .finish()
    }
}

impl EventLog {
    /// An empty log of a response about to run: its bytes count among the running logs'.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(LogState {
                live: true,
                ..LogState::default()
            }),
            changed: watch::channel(()).0,
        })
    }

    /// A receiver marked changed at each change of the log: mark it seen
    /// (`borrow_and_update`) before [`EventLog::read`], then wait on `changed()`.
    pub fn subscribe(&self) -> watch::Receiver<()> {
        self.changed.subscribe()
    }

    /// The events from sequence number `next` on, at most `max_frames` and about `max_bytes`
    /// (at least one).
    pub fn read(&self, next: u64, max_frames: usize, max_bytes: usize) -> Read {
        let state = self.state.lock();
        if let Some(gone) = state.gone {
            return Read::Gone(gone);
        }
        if next < state.first {
            return Read::Behind(state.first);
        }
        if next >= state.end() {
            return if state.ended { Read::Ended } else { Read::Wait };
        }
        let skip = usize::try_from(next - state.first).unwrap_or(usize::MAX);
        let mut bytes = 0usize;
        let frames: Vec<Bytes> = state
            .frames
            .iter()
            .skip(skip)
            .take(max_frames.max(1))
            .take_while(|f| {
                let first = bytes == 0;
                bytes = bytes.saturating_add(f.len());
                first || bytes <= max_bytes
            })
            .cloned()
            .collect();
        let after = next + frames.len() as u64;
        Read::Frames(frames, after)
    }

    /// The oldest kept event's sequence number, and the next one's.
    pub fn span(&self) -> (u64, u64) {
        let state = self.state.lock();
        (state.first, state.end())
    }

    /// Why its response left the store, and its events with it, if it did.
    pub fn gone(&self) -> Option<Gone> {
        self.state.lock().gone
    }

    /// Whether its last event is in.
    pub fn has_ended(&self) -> bool {
        self.state.lock().ended
    }

    /// Its bytes now.
    pub fn bytes(&self) -> usize {
        self.state.lock().bytes
    }

    pub(super) fn lock(&self) -> parking_lot::MutexGuard<'_, LogState> {
        self.state.lock()
    }

    pub(super) fn wake(&self) {
        self.changed.send_replace(());
    }
}

impl StoreLimits {
    /// Most bytes of events one background response keeps: an eighth of the store's byte
    /// bound.
    pub fn max_event_bytes(&self) -> usize {
        self.max_bytes / 8
    }
}

/// Counts an ended log's bytes in the stored entry that takes it ([`ResponseStore::insert`]
/// with events): the bytes the entry counts for it (0 for a log still running, whose bytes
/// count among the running logs').
pub(super) fn move_into_entry(live_bytes: &mut usize, log: &EventLog) -> usize {
    let mut state = log.lock();
    if !state.ended {
        return 0;
    }
    stop_counting(live_bytes, &mut state);
    state.in_entry = true;
    state.bytes
}

/// The bytes an ended log would bring into the entry that takes it (0 for a running one).
pub(super) fn ended_bytes(log: &EventLog) -> usize {
    let state = log.lock();
    if state.ended {
        state.bytes
    } else {
        0
    }
}

fn stop_counting(live_bytes: &mut usize, state: &mut LogState) {
    if state.live {
        *live_bytes -= state.bytes;
        state.live = false;
    }
}

/// Ends `log`, which no task writes any more and no stored entry takes: with readers holding
/// it, its bytes still count among the running logs' (kept for those readers, in
/// [`Inner::for_readers`], until the last one lets go or the bound needs the room); without,
/// they stop counting. A log in an entry, or closed, stays as it is.
pub(super) fn release(inner: &mut Inner, log: &Arc<EventLog>) {
    let mut state = log.lock();
    state.ended = true;
    if !state.in_entry && state.gone.is_none() {
        if state.readers > 0 {
            keep_for_readers(inner, &mut state, log);
        } else {
            stop_counting(&mut inner.live_bytes, &mut state);
        }
    }
    drop(state);
    log.wake();
}

/// Counts `log` (ended, its readers holding it) among the logs kept for their readers.
fn keep_for_readers(inner: &mut Inner, state: &mut LogState, log: &Arc<EventLog>) {
    if state.for_readers.is_some() {
        return;
    }
    if !state.live {
        inner.live_bytes += state.bytes;
        state.live = true;
    }
    let key = inner.next_for_readers;
    inner.next_for_readers += 1;
    inner.for_readers.insert(key, Arc::clone(log));
    state.for_readers = Some(key);
}

/// Drops `log`'s events, its response having left the store (`gone` says how): its readers
/// end with the `error` event that says so. A running log stops counting among the running
/// logs (its task's later events are dropped), and one kept for its readers leaves them.
pub(super) fn close(inner: &mut Inner, log: &EventLog, gone: Gone) {
    let mut state = log.lock();
    stop_counting(&mut inner.live_bytes, &mut state);
    if let Some(key) = state.for_readers.take() {
        inner.for_readers.remove(&key);
    }
    state.frames = VecDeque::new();
    state.bytes = 0;
    state.ended = true;
    state.gone = Some(gone);
    drop(state);
    log.wake();
}

/// Closes the oldest log kept for its readers alone (they end with `response_evicted`), to
/// make room once no stored response is left to evict: whether there was one. It is never a
/// log the caller has locked to append to: a log kept for readers has ended.
pub(super) fn evict_one_for_readers(inner: &mut Inner) -> bool {
    let Some((_, log)) = inner.for_readers.pop_first() else {
        return false;
    };
    close(inner, &log, Gone::Evicted);
    true
}

impl ResponseStore {
    /// Appends `frames`, the next events of running `log` in order (`last`: its last ones),
    /// counting their bytes (see the module docs for the bounds, and what leaves to keep them).
    /// A log that has ended (cancelled meanwhile) takes nothing more.
    pub fn record_events(&self, log: &EventLog, frames: Vec<Bytes>, last: bool) {
        let mut inner = self.inner.lock();
        let mut state = log.lock();
        if state.ended {
            return;
        }
        self.append(&mut inner, &mut state, frames, last);
        drop(state);
        inner.publish();
        drop(inner);
        log.wake();
    }

    /// Ends `log` with the event `last` writes for its next sequence number, unless it has
    /// ended: a cancelled response's, or one whose task ended without its last event.
    pub fn end_events(&self, log: &EventLog, last: impl FnOnce(u64) -> Bytes) {
        let mut inner = self.inner.lock();
        let mut state = log.lock();
        if state.ended {
            return;
        }
        let frame = last(state.end());
        self.append(&mut inner, &mut state, vec![frame], true);
        drop(state);
        inner.publish();
        drop(inner);
        log.wake();
    }

    pub(super) fn append(
        &self,
        inner: &mut Inner,
        state: &mut LogState,
        frames: Vec<Bytes>,
        last: bool,
    ) {
        let added: usize = frames.iter().map(Bytes::len).sum();
        state.frames.extend(frames);
        state.bytes += added;
        if state.live {
            inner.live_bytes += added;
        }
        let cap = self.limits.max_event_bytes();
        // The last event always stays: a reader that kept up still gets it.
        while state.bytes > cap && state.frames.len() > 1 {
            let freed = state.pop();
            if state.live {
                inner.live_bytes -= freed;
            }
        }
        while state.live && inner.bytes + inner.live_bytes > self.limits.max_bytes {
            // Finished responses leave first (a running one is out of the order, its own
            // `queued` entry included), then the log's own oldest events. An evicted entry's
            // log is locked to close it while this one is: it is another log, as a log still
            // appended to is only ever held by a running entry, and a closed log is never
            // appended to, so two appends cannot wait on each other's logs.
            if let Some((_, oldest)) = inner.order.first_key_value() {
                let oldest = oldest.clone();
                inner.remove(&oldest, Gone::Evicted);
                self.journal_delete(&oldest);
                metrics::counter!(RESPONSES_EVICTED, "reason" => "bytes").increment(1);
            } else if evict_one_for_readers(inner) {
                // A response not kept whose readers still read it went (it has ended, so it
                // is another log than this one).
            } else if state.frames.len() > 1 {
                let freed = state.pop();
                inner.live_bytes -= freed;
            } else {
                break;
            }
        }
        state.ended = last;
    }

    /// Ends `log`, whose task has ended: a log no stored entry took (the response was
    /// deleted, or its end was too large to keep) stops counting among the running logs once
    /// no reader holds it ([`release`]).
    pub fn release_events(&self, log: &Arc<EventLog>) {
        let mut inner = self.inner.lock();
        release(&mut inner, log);
        inner.publish();
    }

    /// A reader's hold on `log`, which a running task writes or a stored entry holds (the
    /// answer to `POST` with `background` and `stream`; [`ResponseStore::get_for_stream`]
    /// takes one under its look): while held, the log counts against the byte bound even once
    /// neither holds it.
    pub fn hold_events(self: &Arc<Self>, log: &Arc<EventLog>) -> ReaderHold {
        let mut inner = self.inner.lock();
        self.hold_locked(&mut inner, log)
    }

    /// [`ResponseStore::hold_events`] under the store's lock.
    pub(super) fn hold_locked(
        self: &Arc<Self>,
        inner: &mut Inner,
        log: &Arc<EventLog>,
    ) -> ReaderHold {
        let mut state = log.lock();
        state.readers += 1;
        if state.ended && !state.live && !state.in_entry && state.gone.is_none() {
            // Released before this reader came: counted again while it reads.
            keep_for_readers(inner, &mut state, log);
            drop(state);
            inner.publish();
        }
        ReaderHold {
            store: Arc::clone(self),
            log: Arc::clone(log),
        }
    }

    /// Logs kept for their readers alone now (see [`release`]).
    pub fn logs_kept_for_readers(&self) -> usize {
        self.inner.lock().for_readers.len()
    }

    /// Bytes the events of running background responses count now.
    pub fn live_event_bytes(&self) -> usize {
        self.inner.lock().live_bytes
    }
}

#[cfg(test)]
mod tests;
