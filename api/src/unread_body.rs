//! A response sent before its request's body has all arrived closes the connection, within
//! actix's `client_disconnect_timeout`, whatever the body's framing.
//!
//! actix-http's HTTP/1 dispatcher decides what to do with a body still arriving when it has
//! written a response: if the handler still holds the body's stream it closes the connection
//! (after lingering `client_disconnect_timeout` to let the client read the response); if the
//! stream was dropped and the body is chunked, it instead keeps reading and discarding the
//! rest of the body, so as to reuse the connection, with no timer at all, and whatever the
//! response's own `Connection: close`. A handler that gives up on a body (the 408 of a body that
//! stops arriving, the 413 of one too large, a key check's 401) drops its stream, so a client
//! that stalls its chunked body after the answer (or keeps sending one) held the connection for
//! as long as it liked: the slow-loris attack the body timeout is there to stop.
//!
//! [`hold_request_body`] keeps every request's body stream alive until the response has been
//! written (in the response body, or in the error a middleware answered with), so that the
//! dispatcher always takes the bounded close. A body read to its end is unaffected: the
//! dispatcher has finished with it by then and keeps the connection alive as before.

use std::cell::RefCell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::error::PayloadError;
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpResponse, ResponseError};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};

/// A request's body stream, shared by the handler (which reads it) and the response (which
/// keeps it alive until it has been written).
type Shared = Rc<RefCell<Payload>>;

/// Middleware: the handler reads the request's body through a shared handle, and the response
/// (or the error a middleware refused the request with) keeps the body alive until written.
pub(crate) async fn hold_request_body(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<HeldBody<BoxBody>>, actix_web::Error> {
    let held = match req.take_payload() {
        Payload::None => None,
        payload => {
            let shared: Shared = Rc::new(RefCell::new(payload));
            req.set_payload(Payload::Stream {
                payload: Box::pin(SharedStream(shared.clone())),
            });
            Some(shared)
        }
    };
    match next.call(req).await {
        Ok(res) => Ok(res.map_body(|_, body| HeldBody {
            body: body.boxed(),
            _held: held,
        })),
        Err(error) => match held {
            Some(held) => Err(HeldError { error, held }.into()),
            None => Err(error),
        },
    }
}

/// The handler's end of a [`Shared`] body.
struct SharedStream(Shared);

impl Stream for SharedStream {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.borrow_mut().poll_next_unpin(cx)
    }
}

/// A response body that keeps its request's body alive until it is dropped, which the
/// dispatcher does only once it has decided the connection's fate.
pub(crate) struct HeldBody<B> {
    body: B,
    _held: Option<Shared>,
}

impl<B: MessageBody + Unpin> MessageBody for HeldBody<B> {
    type Error = B::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Pin::new(&mut self.body).poll_next(cx)
    }

    // `try_into_bytes` keeps its default (`Err(self)`): handing the bytes out would drop the
    // request's body before the dispatcher has looked at it.
}

/// A middleware's refusal (a key check's 401), rendered with a body that keeps the request's
/// body alive as [`HeldBody`] does.
struct HeldError {
    error: actix_web::Error,
    held: Shared,
}

impl std::fmt::Debug for HeldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The body stream has no `Debug`.
        f.debug_struct("HeldError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for HeldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl ResponseError for HeldError {
    fn status_code(&self) -> StatusCode {
        self.error.as_response_error().status_code()
    }

    fn error_response(&self) -> HttpResponse {
        let held = self.held.clone();
        self.error.error_response().map_body(|_, body| {
            BoxBody::new(HeldBody {
                body,
                _held: Some(held),
            })
        })
    }
}
