//! Route table, HTTP metrics and request-id middleware, and the server builder.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{BodySize, MessageBody};
use actix_web::dev::{Server, ServiceRequest, ServiceResponse};
use actix_web::http::{ConnectionType, Version};
use actix_web::middleware::{from_fn, Condition, Next};
use actix_web::{web, App, HttpRequest, HttpServer};

use crate::auth::{require_admin_key, require_api_key};
use crate::metrics::HttpRecord;
use crate::request_id::add_request_id;
use crate::routes;
use crate::state::ApiState;
use crate::tls::CertificateResolver;
use crate::unread_body::hold_request_body;

/// Registers every route on an actix-web app or scope.
///
/// ```no_run
/// # fn f(state: switchyard_api::ApiState) {
/// let app = actix_web::App::new().configure(|cfg| switchyard_api::configure(cfg, state.clone()));
/// # }
/// ```
pub fn configure(cfg: &mut web::ServiceConfig, state: ApiState) {
    let method_not_allowed = |allow: &'static str| {
        web::to(move |req: HttpRequest| routes::method_not_allowed(req, allow))
    };
    // One outer scope, so that every response (errors, 404s and the key checks' refusals
    // included) passes the request-id middleware; unmatched paths reach the app's default
    // service through the innermost scope `""`. Outermost but for the HTTP/1.0 framing of a
    // stream (`unchunked_for_http10`), the request's body is kept until its response is
    // written: one answered before the body ended closes its connection (see `unread_body`). CORS, when configured, sits inside the request id (its answers
    // carry one) and outside the key checks (a preflight carries no key); its refusals become
    // OpenAI error bodies just outside it.
    let config = state.config();
    let cors = config.cors.as_ref();
    let cors = Condition::new(
        cors.is_some(),
        cors.map_or_else(actix_cors::Cors::default, |c| c.middleware()),
    );
    let all = web::scope("")
        .wrap(cors)
        .wrap(from_fn(crate::cors::json_refusals))
        .wrap(from_fn(add_request_id))
        .wrap(from_fn(hold_request_body))
        .wrap(from_fn(unchunked_for_http10))
        // vLLM's routes for the admin API's LoRA loads (the admin key, not an API key), ahead
        // of the `/v1` scope that would take them for its own.
        .service(
            web::resource("/v1/load_lora_adapter")
                .wrap(from_fn(require_admin_key))
                .wrap(from_fn(record_http))
                .route(web::post().to(routes::vllm_load_lora))
                .default_service(method_not_allowed("POST")),
        )
        .service(
            web::resource("/v1/unload_lora_adapter")
                .wrap(from_fn(require_admin_key))
                .wrap(from_fn(record_http))
                .route(web::post().to(routes::vllm_unload_lora))
                .default_service(method_not_allowed("POST")),
        )
        .service(
            web::scope("/v1")
                .wrap(from_fn(require_api_key))
                .wrap(from_fn(record_http))
                .service(
                    web::resource("/completions")
                        .route(web::post().to(routes::completions))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/chat/completions")
                        .route(web::post().to(routes::chat_completions))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/embeddings")
                        .route(web::post().to(routes::embeddings))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/responses")
                        .route(web::post().to(routes::create_response))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/responses/{id}")
                        .route(web::get().to(routes::retrieve_response))
                        .route(web::delete().to(routes::delete_response))
                        .default_service(method_not_allowed("GET, DELETE")),
                )
                .service(
                    web::resource("/responses/{id}/input_items")
                        .route(web::get().to(routes::list_input_items))
                        .default_service(method_not_allowed("GET")),
                )
                .service(
                    web::resource("/responses/{id}/cancel")
                        .route(web::post().to(routes::cancel_response))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/models")
                        .route(web::get().to(routes::list_models))
                        .default_service(method_not_allowed("GET")),
                )
                .service(
                    // Served names may hold slashes (`org/model`).
                    web::resource("/models/{id:.+}")
                        .route(web::get().to(routes::retrieve_model))
                        .default_service(method_not_allowed("GET")),
                ),
        )
        .service(
            web::scope("/admin")
                .wrap(from_fn(require_admin_key))
                .wrap(from_fn(record_http))
                .service(
                    web::resource("/policy")
                        .route(web::get().to(routes::get_policy))
                        .route(web::put().to(routes::put_policy))
                        .default_service(method_not_allowed("GET, PUT")),
                )
                .service(
                    web::resource("/speculative")
                        .route(web::get().to(routes::get_speculative))
                        .route(web::put().to(routes::put_speculative))
                        .default_service(method_not_allowed("GET, PUT")),
                )
                .service(
                    web::resource("/lora")
                        .route(web::get().to(routes::list_lora))
                        .route(web::post().to(routes::load_lora))
                        .default_service(method_not_allowed("GET, POST")),
                )
                .service(
                    web::resource("/lora/{name}")
                        .route(web::delete().to(routes::unload_lora))
                        .default_service(method_not_allowed("DELETE")),
                )
                .service(
                    web::resource("/rate_limits")
                        .route(web::get().to(routes::get_rate_limits))
                        .default_service(method_not_allowed("GET")),
                )
                .service(
                    web::resource("/rate_limits/{tier}/{tenant}")
                        .route(web::delete().to(routes::reset_rate_limit))
                        .default_service(method_not_allowed("DELETE")),
                ),
        )
        .service(
            web::scope("")
                .wrap(from_fn(record_http))
                .service(
                    web::resource("/tokenize")
                        .wrap(from_fn(require_api_key))
                        .route(web::post().to(routes::tokenize))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/detokenize")
                        .wrap(from_fn(require_api_key))
                        .route(web::post().to(routes::detokenize))
                        .default_service(method_not_allowed("POST")),
                )
                .service(
                    web::resource("/health")
                        .route(web::get().to(routes::health))
                        .route(web::head().to(routes::health))
                        .default_service(method_not_allowed("GET, HEAD")),
                )
                .service(
                    web::resource("/version")
                        .route(web::get().to(routes::version))
                        .default_service(method_not_allowed("GET")),
                )
                .service(
                    web::resource("/ready")
                        .route(web::get().to(routes::ready))
                        .route(web::head().to(routes::ready))
                        .default_service(method_not_allowed("GET, HEAD")),
                )
                .service(
                    web::resource("/metrics")
                        .route(web::get().to(routes::metrics))
                        .route(web::head().to(routes::metrics))
                        .default_service(method_not_allowed("GET, HEAD")),
                ),
        );
    cfg.app_data(web::Data::new(state))
        .service(all)
        .default_service(web::to(routes::not_found));
}

/// HTTP/1.0 has no chunked transfer coding (a server must not send one to an HTTP/1.0
/// client, RFC 9112, 6.1 and 7: the client would read the chunk sizes as part of the body), but
/// actix-http frames every body of unknown length in chunks whatever the request's version. A
/// streamed response (the SSE of `stream: true`) to an HTTP/1.0 request is sent as it is,
/// delimited by closing the connection, as HTTP/1.0 delimits a body of unknown length.
async fn unchunked_for_http10(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let http10 = req.version() < Version::HTTP_11;
    let mut res = next.call(req).await?;
    if http10 && res.response().body().size() == BodySize::Stream {
        let head = res.response_mut().head_mut();
        head.no_chunking(true);
        head.set_connection_type(ConnectionType::Close);
    }
    Ok(res)
}

/// Counts responses by route template and status, and times them. A request whose handler is
/// dropped before it answers (the client closed the connection) counts with status
/// [`crate::metrics::CLIENT_CLOSED_REQUEST`] (499), through [`HttpRecord`]'s drop.
async fn record_http(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    // The route is matched against the whole app's routes, so it is known before routing.
    let mut record = HttpRecord::new(req.match_pattern());
    let result = next.call(req).await;
    let (route, status) = match &result {
        Ok(res) => (res.request().match_pattern(), res.status()),
        Err(e) => (record.take_route(), e.as_response_error().status_code()),
    };
    record.record(route, status.as_u16());
    result
}

/// How long a connection answered before its request's body ended stays open before it is
/// closed (actix's `client_disconnect_timeout`).
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// How to run the HTTP server.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptions {
    /// Addresses to listen on.
    pub bind: Vec<SocketAddr>,
    /// HTTP worker threads; 0 means one per CPU core.
    pub workers: usize,
    /// Time a client may take to send its request head (else 408).
    pub client_request_timeout: Duration,
    /// Time actix waits for open connections after `stop(true)` before closing them.
    pub shutdown_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            bind: vec![SocketAddr::from(([127, 0, 0, 1], 8000))],
            workers: 0,
            client_request_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// Binds the server and returns it with the addresses it listens on (a port 0 asked for is
/// the one the system picked). The caller awaits the returned [`Server`] inside an actix (or
/// `#[actix_web::main]`) runtime and keeps `server.handle()` to stop it. actix-web's own
/// signal handling is disabled: the binary drains with [`ApiState::begin_drain`] and
/// [`ApiState::wait_idle`], then calls `handle.stop(true)`.
pub fn build_server(
    state: ApiState,
    options: &ServerOptions,
) -> std::io::Result<(Server, Vec<SocketAddr>)> {
    build_server_on(state, options, Vec::new(), None)
}

/// [`build_server`], listening on `listeners` (sockets the caller bound already, so that an
/// address in use is found before a slow start) as well as on `options.bind`; with `tls`,
/// every one of them speaks HTTPS only, with the certificate `tls` holds at each handshake.
pub fn build_server_on(
    state: ApiState,
    options: &ServerOptions,
    listeners: Vec<std::net::TcpListener>,
    tls: Option<Arc<CertificateResolver>>,
) -> std::io::Result<(Server, Vec<SocketAddr>)> {
    let tls = tls
        .map(crate::tls::server_config)
        .transpose()
        .map_err(std::io::Error::other)?;
    let app_state = state.clone();
    let mut server = HttpServer::new(move || {
        let state = app_state.clone();
        App::new().configure(move |cfg| configure(cfg, state))
    })
    .disable_signals()
    // A client that closes its end has left: end the connection, which drops the handler
    // future or the response body and so aborts the engine request (see `engine` docs).
    .h1_allow_half_closed(false)
    .client_request_timeout(options.client_request_timeout)
    // How long a connection answered before its request's body ended lingers (reading and
    // discarding, so that the client gets the response) before it is closed; actix's default,
    // set here because `unread_body` relies on it to bound such a connection.
    .client_disconnect_timeout(CLOSE_LINGER)
    .shutdown_timeout(options.shutdown_timeout.as_secs());
    if options.workers > 0 {
        server = server.workers(options.workers);
    }
    for addr in &options.bind {
        server = match &tls {
            Some(tls) => server.bind_rustls_0_23(addr, tls.clone())?,
            None => server.bind(addr)?,
        };
    }
    for listener in listeners {
        server = match &tls {
            Some(tls) => server.listen_rustls_0_23(listener, tls.clone())?,
            None => server.listen(listener)?,
        };
    }
    let addrs = server.addrs();
    Ok((server.run(), addrs))
}
