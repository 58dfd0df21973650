//! Signals while serving: SIGTERM or SIGINT drains then stops, SIGHUP reloads (see
//! [`super::reload`]).
//!
//! The drain refuses new work (503) and waits for the requests in flight, up to
//! `server.drain_timeout_s`; the requests still running then end with an `unavailable` error
//! and get [`DRAIN_GRACE`] to write it. A second SIGTERM or SIGINT during the drain ends it at
//! once, the same way (as uvicorn and vLLM do: an operator pressing Ctrl-C twice does not wait
//! out the timeout), and one more during the grace closes the connections still open.

use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use switchyard_actors::actors::Engine as ActorEngine;
use switchyard_api::ApiState;
use tokio::signal::unix::Signal;

use super::reload::Reloader;
use crate::commands::stop_signals::StopSignals;

/// How long, past the drain's end, the requests failed then get to write their error.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// What the server needs to drain and stop.
pub(super) struct Shutdown {
    /// The HTTP layer's state (readiness, requests in flight).
    pub(super) state: ApiState,
    /// The engine, to fail what is still in flight.
    pub(super) engine: ActorEngine,
    /// Stops the HTTP server.
    pub(super) handle: ServerHandle,
    /// `server.drain_timeout_s`.
    pub(super) drain: Duration,
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainEnd {
    /// Nothing was left in flight.
    Idle,
    /// `server.drain_timeout_s` passed.
    Timeout,
    /// A second SIGTERM or SIGINT arrived.
    Signal,
}

/// Handles signals until the server is stopped: SIGHUP spawns a reload, the first SIGTERM or
/// SIGINT drains and stops the server. `stops` are the listeners the model load watched, so a
/// signal sent while the engine started is seen here.
pub(super) async fn handle_signals(
    mut hangup: Signal,
    mut stops: StopSignals,
    reloader: Arc<Reloader>,
    s: Shutdown,
) {
    loop {
        tokio::select! {
            _ = stops.recv() => break,
            _ = hangup.recv() => reloader.spawn(),
        }
    }
    tracing::info!(
        timeout_s = s.drain.as_secs(),
        "draining: new requests get 503 (a second SIGTERM or SIGINT ends the drain now)"
    );
    s.state.begin_drain();
    let end = tokio::select! {
        _ = s.state.wait_idle() => DrainEnd::Idle,
        _ = tokio::time::sleep(s.drain) => DrainEnd::Timeout,
        _ = stops.recv() => DrainEnd::Signal,
    };
    let mut idle = end == DrainEnd::Idle;
    if !idle {
        // Every request still in flight ends with a 503 error (a stream with an error event
        // and [DONE]); they get a short grace to write it, then what is left is cut off.
        let why = match end {
            DrainEnd::Signal => {
                tracing::warn!(
                    "second signal: ending the drain now, {} requests cut off",
                    s.state.in_flight()
                );
                "the server is shutting down: a second signal ended the drain before this \
                 request finished"
            }
            _ => {
                tracing::warn!("drain timeout reached: failing the requests still in flight");
                "the server is shutting down: this request did not finish within the drain \
                 timeout (server.drain_timeout_s)"
            }
        };
        s.engine.fail_in_flight(why);
        idle = tokio::select! {
            r = tokio::time::timeout(DRAIN_GRACE, s.state.wait_idle()) => r.is_ok(),
            _ = stops.recv() => false,
        };
        if !idle {
            tracing::warn!("closing the connections still open");
        }
    }
    // Graceful once nothing is in flight: the last responses are still being written.
    s.handle.stop(idle).await;
}
