//! Streams of background responses' kept events ([`EventLog`]): the answer to
//! `POST /v1/responses` with `background` and `stream`, and to
//! `GET /v1/responses/{id}?stream=true&starting_after=N` (OpenAI's resumable streams).
//!
//! A stream reads the log from a sequence number on: the events kept are sent at once, then
//! each new one as it is appended, until the log has ended (its `response.completed`,
//! `response.incomplete` or `error` event, or the `error` event of a cancel). The stream holds
//! no events of its own, only its place in the log, so a slow reader grows no memory; one that
//! falls behind the oldest event the log keeps is cut off with an `error` event, and one
//! reading a response that leaves the store (deleted, evicted, expired or replaced) ends at once
//! with an `error` event saying so (`response_deleted`, `response_evicted`,
//! `response_replaced`), the events being dropped with it. A client that
//! hangs up ends its stream only: the response runs on (as the `heartbeat` comments, sent when
//! nothing else is, let a closed connection show). A drain ends the streams as it ends the
//! responses: with the `error` event of a response cut at the drain timeout.

use std::convert::Infallible;

use actix_web::http::header;
use actix_web::{web, HttpResponse};
use bytes::{Bytes, BytesMut};
use serde_json::json;

use crate::error::ApiError;
use crate::response_store::{Gone, Read, ReaderHold, StoreLimits, StoredResponse};
use crate::sse::{event_frame, HEARTBEAT, HEARTBEAT_FRAME};

/// Most events one chunk of a stream carries.
const MAX_CHUNK_EVENTS: usize = 256;
/// About the most bytes one chunk carries (at least one event).
const MAX_CHUNK_BYTES: usize = 64 << 10;

/// `GET /v1/responses/{id}`'s query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct RetrieveQuery {
    /// `stream=true`: the response's events rather than its object.
    pub(super) stream: bool,
    /// `starting_after`: the sequence number after which the stream starts.
    pub(super) starting_after: Option<u64>,
}

impl RetrieveQuery {
    /// Reads `stream` (`true` or `false`) and `starting_after` (a non-negative integer, only
    /// with `stream=true`); any other parameter (OpenAI's `include`, `include_obfuscation`) is
    /// a 400 naming it, rather than an answer that ignores it.
    pub(super) fn parse(query: &str) -> Result<Self, ApiError> {
        let pairs = web::Query::<Vec<(String, String)>>::from_query(query)
            .map_err(|_| ApiError::invalid("query", "the query string is not valid"))?
            .into_inner();
        let mut q = Self::default();
        for (name, value) in pairs {
            match name.as_str() {
                "stream" => {
                    q.stream = match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => return Err(ApiError::invalid("stream", "stream is true or false")),
                    }
                }
                "starting_after" => {
                    let n = value.parse::<u64>().map_err(|_| {
                        ApiError::invalid(
                            "starting_after",
                            "starting_after is a non-negative integer: the sequence_number of \
                             the last event received",
                        )
                    })?;
                    q.starting_after = Some(n);
                }
                other => {
                    return Err(super::unsupported_query_parameter(
                        other,
                        "stream (true: the events of a background response created with \
                         stream = true) and starting_after",
                    ))
                }
            }
        }
        if q.starting_after.is_some() && !q.stream {
            return Err(ApiError::invalid(
                "starting_after",
                "starting_after needs stream=true (it says where a stream of events resumes)",
            ));
        }
        Ok(q)
    }
}

/// The stream of stored response `stored`'s events after sequence number `starting_after`
/// (all without it), or the 400 of a response whose events cannot be streamed: not a
/// background response (as OpenAI refuses it), one whose events are not kept (created without
/// `stream`, or read back from the journal after a restart), or a resume from before the
/// oldest event kept. `events` is what [`crate::response_store::ResponseStore::get_for_stream`]
/// found with the response: a hold on its events and the oldest one kept, as they were when
/// it was looked up, so that a DELETE coming after the look ends the stream with
/// `response_deleted` rather than turning it into a 400.
pub(super) fn stream_stored(
    stored: &StoredResponse,
    events: Option<(u64, ReaderHold)>,
    starting_after: Option<u64>,
    limits: StoreLimits,
) -> Result<HttpResponse, ApiError> {
    if stored.response["background"] != true {
        return Err(ApiError::invalid(
            "stream",
            "only a background response can be streamed: this one was created with background \
             = false (its stream ended with its request); GET it without stream for the \
             response object",
        ));
    }
    let Some((first, hold)) = events else {
        return Err(ApiError::invalid(
            "stream",
            "this response's events are not kept: only those of a background response created \
             with stream = true are, in memory (not across a restart of the server); GET it \
             without stream for the response object",
        ));
    };
    let next = starting_after.map_or(0, |n| n.saturating_add(1));
    // A resume from before the oldest kept event whose response has left the store since the
    // look (deleted, evicted) streams too: its reader says why at once, as any reader of it.
    if next < first && hold.log().gone().is_none() {
        return Err(ApiError::invalid(
            "starting_after",
            format!(
                "the events before sequence number {first} are no longer kept (a response keeps \
                 its last {} bytes of events, an eighth of server.responses.max_stored_mb): \
                 resume with starting_after {} or more, or GET the response object",
                limits.max_event_bytes(),
                first - 1
            ),
        ));
    }
    Ok(stream_events(hold, next))
}

/// A reader's place in a log.
struct Reader {
    /// The log, held (its bytes count while the reader reads them).
    log: ReaderHold,
    changes: tokio::sync::watch::Receiver<()>,
    /// The sequence number of the next event to send.
    next: u64,
    /// Cut off: nothing more is sent.
    done: bool,
}

/// Streams the held log's events from sequence number `next` on as SSE, then the new ones as
/// they come, until it has ended; the hold is let go when the stream ends or is dropped.
pub(super) fn stream_events(log: ReaderHold, next: u64) -> HttpResponse {
    let reader = Reader {
        changes: log.log().subscribe(),
        log,
        next,
        done: false,
    };
    let body = futures_util::stream::unfold(reader, |mut r| async move {
        if r.done {
            return None;
        }
        loop {
            // Seen before reading: a change after the read wakes the wait below.
            r.changes.borrow_and_update();
            match r.log.log().read(r.next, MAX_CHUNK_EVENTS, MAX_CHUNK_BYTES) {
                Read::Frames(frames, after) => {
                    r.next = after;
                    return Some((Ok::<_, Infallible>(join(frames)), r));
                }
                Read::Ended => return None,
                Read::Behind(first) => {
                    r.done = true;
                    let frame = cut_off_event(r.next, first);
                    return Some((Ok(frame), r));
                }
                Read::Gone(gone) => {
                    r.done = true;
                    return Some((Ok(gone_event(r.next, gone)), r));
                }
                Read::Wait => {
                    match tokio::time::timeout(HEARTBEAT, r.changes.changed()).await {
                        Err(_) => return Some((Ok(Bytes::from_static(HEARTBEAT_FRAME)), r)),
                        Ok(Ok(())) => {}
                        // The log is held here, so its sender cannot be gone; end if it is.
                        Ok(Err(_)) => return None,
                    }
                }
            }
        }
    });
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, "text/event-stream"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body)
}

fn join(frames: Vec<Bytes>) -> Bytes {
    if frames.len() == 1 {
        return frames.into_iter().next().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(frames.iter().map(Bytes::len).sum());
    for frame in frames {
        out.extend_from_slice(&frame);
    }
    out.freeze()
}

/// OpenAI's `error` event numbered `sequence`.
pub(super) fn error_event(sequence: u64, code: &str, message: &str) -> Bytes {
    event_frame(
        "error",
        &json!({"type": "error", "sequence_number": sequence, "code": code,
                "message": message, "param": null}),
    )
}

/// The `error` event of a response cancelled while it ran (`POST .../cancel` or `DELETE`).
pub(super) fn cancelled_event(sequence: u64) -> Bytes {
    error_event(
        sequence,
        "response_cancelled",
        "The response was cancelled (POST /v1/responses/{id}/cancel or DELETE) before it ended.",
    )
}

/// The `error` event of a reader whose response left the store, and its events with it: it
/// takes the sequence number of the event it would have read next.
fn gone_event(next: u64, gone: Gone) -> Bytes {
    let (code, why) = match gone {
        Gone::Deleted => (
            "response_deleted",
            "The response was deleted (DELETE /v1/responses/{id}); a running one was cancelled.",
        ),
        Gone::Evicted => (
            "response_evicted",
            "The response is no longer stored: the server let it go to stay within its bounds \
             (server.responses.max_stored, max_stored_mb, max_age_s), and its events with it.",
        ),
        Gone::Replaced => (
            "response_replaced",
            "The response is no longer stored: another response of its id (X-Request-Id) \
             replaced it, and its events with it.",
        ),
    };
    error_event(next, code, why)
}

/// The `error` event of a reader that fell behind the oldest event kept: it takes the
/// sequence number of the event it missed.
fn cut_off_event(missed: u64, first: u64) -> Bytes {
    error_event(
        missed,
        "stream_cut_off",
        &format!(
            "The stream was cut off: the client read it more slowly than the response wrote \
             it, and the events from {missed} to {} are no longer kept. Resume with \
             starting_after={} (what came before is lost), or GET the response once it has \
             ended.",
            first - 1,
            first - 1
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn parsed(query: &str) -> Result<RetrieveQuery, Option<String>> {
        RetrieveQuery::parse(query).map_err(|e| match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("{query}: {other:?}"),
        })
    }

    /// `stream` and `starting_after` are read; every other parameter, a bad value, or
    /// `starting_after` without `stream=true` is a 400 naming it.
    #[test]
    fn the_retrieve_query_takes_stream_and_starting_after_only() {
        let q = |stream, starting_after| {
            Ok(RetrieveQuery {
                stream,
                starting_after,
            })
        };
        assert_eq!(parsed(""), q(false, None));
        assert_eq!(parsed("stream=false"), q(false, None));
        assert_eq!(parsed("stream=true"), q(true, None));
        assert_eq!(parsed("stream=true&starting_after=0"), q(true, Some(0)));
        assert_eq!(
            parsed("starting_after=18446744073709551615&stream=true"),
            q(true, Some(u64::MAX))
        );
        for (query, param) in [
            ("stream=1", "stream"),
            ("stream=yes", "stream"),
            ("stream=true&starting_after=-1", "starting_after"),
            ("stream=true&starting_after=1.5", "starting_after"),
            ("stream=true&starting_after=", "starting_after"),
            (
                "stream=true&starting_after=18446744073709551616",
                "starting_after",
            ),
            ("starting_after=3", "starting_after"),
            ("stream=false&starting_after=3", "starting_after"),
            ("include[]=message.output_text.logprobs", "include[]"),
            (
                "stream=true&include_obfuscation=false",
                "include_obfuscation",
            ),
        ] {
            assert_eq!(parsed(query), Err(Some(param.to_owned())), "{query}");
        }
    }

    /// Several events go out as one chunk, byte for byte.
    #[test]
    fn frames_join_in_order() {
        let frames = vec![Bytes::from_static(b"a\n\n"), Bytes::from_static(b"bc\n\n")];
        assert_eq!(&join(frames)[..], b"a\n\nbc\n\n");
        assert_eq!(&join(vec![Bytes::from_static(b"x")])[..], b"x");
        assert!(join(Vec::new()).is_empty());
    }

    /// The JSON of an `error` event's frame (`event: error`, one `data:` line).
    fn error_data(frame: &[u8]) -> serde_json::Value {
        let text = std::str::from_utf8(frame).unwrap();
        let data = text
            .strip_prefix("event: error\ndata: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .unwrap();
        serde_json::from_str(data).unwrap()
    }

    /// The `error` events carry OpenAI's fields (`ResponseErrorEvent`) and their number.
    #[test]
    fn error_events_are_openais() {
        let frame = cancelled_event(7);
        let v = error_data(&frame);
        assert_eq!(v["type"], "error");
        assert_eq!(v["sequence_number"], 7);
        assert_eq!(v["code"], "response_cancelled");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(v["param"].is_null());
    }

    /// A store holding one running background response `r` of tenant `t` that has recorded
    /// 200 events of 10 bytes, of which it keeps the last 100 (an eighth of `max_bytes` 8000).
    fn running_with_200_events(limits: StoreLimits) -> Arc<crate::response_store::ResponseStore> {
        use crate::response_store::{EventLog, ResponseStore, Turn};
        assert_eq!(limits.max_bytes, 8000);
        let store = Arc::new(ResponseStore::new(limits));
        let log = EventLog::new();
        let (abort, _r) = futures_util::future::AbortHandle::new_pair();
        let queued = StoredResponse {
            response: json!({"id": "r", "status": "queued", "background": true}),
            turn: Arc::new(Turn::new(Vec::new(), Vec::new(), None)),
            events: Some(Arc::clone(&log)),
        };
        store
            .start_background("t", "r", abort, queued)
            .expect("registered");
        let frames = (0..200)
            .map(|_| Bytes::from_static(b"0123456789"))
            .collect();
        store.record_events(&log, frames, false);
        assert_eq!(log.span(), (100, 200));
        store
    }

    /// The whole body of a stream whose events are all there (it never waits).
    fn body_now(answer: HttpResponse) -> String {
        let body =
            futures_util::FutureExt::now_or_never(actix_web::body::to_bytes(answer.into_body()))
                .expect("the stream never waits")
                .unwrap_or_else(|_| panic!("the stream failed"));
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// Regression (a resume racing a DELETE answered a 400): a `GET ?stream=true` that found
    /// the response, then saw its events span apart, could answer a 400 "no longer kept"
    /// where a DELETE came in between. Now, whatever `starting_after` (from the start, past
    /// the end, or before the oldest kept event), a DELETE after the look gives a stream that
    /// ends with `response_deleted`; one before it is a 404 (`get_for_stream` finds nothing).
    #[test]
    fn a_delete_after_the_look_ends_the_stream_deleted() {
        let limits = StoreLimits {
            max_bytes: 8000,
            ..StoreLimits::default()
        };
        for starting_after in [None, Some(0), Some(1000), Some(2)] {
            let store = running_with_200_events(limits);
            let (stored, events) = store.get_for_stream("t", "r").expect("found");
            assert!(store.remove("t", "r"));
            let answer = stream_stored(&stored, events, starting_after, limits)
                .unwrap_or_else(|e| panic!("{starting_after:?}: {e:?}"));
            let body = body_now(answer);
            let next = starting_after.map_or(0, |n| n + 1);
            let data = error_data(body.as_bytes());
            assert_eq!(
                (data["code"].as_str(), data["sequence_number"].as_u64()),
                (Some("response_deleted"), Some(next)),
                "{starting_after:?}: {body}"
            );
            assert!(store.get_for_stream("t", "r").is_none(), "a 404 now");
        }
    }

    /// Without a DELETE, a resume before the oldest kept event is still the 400 that says
    /// where the kept ones start.
    #[test]
    fn a_resume_before_the_oldest_kept_event_is_a_400() {
        let limits = StoreLimits {
            max_bytes: 8000,
            ..StoreLimits::default()
        };
        let store = running_with_200_events(limits);
        let (stored, events) = store.get_for_stream("t", "r").expect("found");
        match stream_stored(&stored, events, Some(2), limits) {
            Err(ApiError::InvalidRequest { param, message, .. }) => {
                assert_eq!(param.as_deref(), Some("starting_after"));
                assert!(message.contains("before sequence number 100"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A reader whose response left the store is told why, at the number it would have read.
    #[test]
    fn a_gone_response_names_why() {
        for (gone, code) in [
            (Gone::Deleted, "response_deleted"),
            (Gone::Evicted, "response_evicted"),
            (Gone::Replaced, "response_replaced"),
        ] {
            let frame = gone_event(4, gone);
            let v = error_data(&frame);
            assert_eq!(
                (v["code"].as_str(), v["sequence_number"].as_u64()),
                (Some(code), Some(4))
            );
        }
    }
}
