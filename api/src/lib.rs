//! Switchyard's HTTP layer: an OpenAI-compatible API on actix-web.
//!
//! The crate knows HTTP and nothing of the engine's internals: it talks to the engine through
//! the [`Engine`] port (see [`engine`] for the request protocol and the abort-on-drop contract).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE),
//! `POST /v1/embeddings`,
//! `POST /v1/responses` (JSON or SSE), `GET`/`DELETE /v1/responses/{id}` and
//! `GET /v1/responses/{id}/input_items` (stored responses, see [`response_store`]), `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize` (all behind the API key),
//! `GET /health`, `GET /ready`,
//! `GET /metrics`, and `GET`/`PUT /admin/policy`, `GET`/`PUT /admin/speculative`,
//! `GET`/`POST /admin/lora` and `DELETE /admin/lora/{name}` (behind the admin key). With
//! [`cors::CorsSettings`] every route answers CORS preflights (without a key); with a
//! [`tls::CertificateResolver`] the server speaks HTTPS.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # async fn run(engine: Arc<dyn switchyard_api::Engine>) -> std::io::Result<()> {
//! use switchyard_api::{ApiConfig, ApiState, ServerOptions};
//! let metrics = switchyard_api::metrics::install_prometheus_recorder().ok();
//! let state = ApiState::new(engine, ApiConfig::default(), metrics);
//! let (server, _addrs) = switchyard_api::build_server(state.clone(), &ServerOptions::default())?;
//! // On SIGTERM: state.begin_drain(); wait for state.wait_idle() (bounded);
//! // then server.handle().stop(true).
//! server.await
//! # }
//! ```

#![warn(missing_docs)]

pub mod auth;
mod body;
pub mod cors;
pub mod engine;
pub mod error;
mod generation;
pub mod metrics;
pub mod objects_only;
pub mod rate_limit;
mod request_id;
pub mod response_store;
mod routes;
pub mod schema;
mod server;
#[path = "../../support/short_number.rs"]
mod short_number;
mod sse;
mod state;
mod throttle;
pub mod tls;
mod unread_body;

pub use auth::{AdapterAccess, ApiConfig, ApiKeyEntry, Principal};
pub use engine::Engine;
pub use error::ApiError;
pub use response_store::StoreLimits;
pub use server::{build_server, build_server_on, configure, ServerOptions};
pub use state::{AccessChange, AccessRefusal, ApiState};
