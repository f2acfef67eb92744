//! The router's HTTP path, native: hyper's server and client on one tokio thread, the decision and all
//! bookkeeping still in Python (router/native_http.py; docs/router.md, "Native HTTP").
//!
//! A generation request whose body is small and plain is read here and handed to Python's ``begin``,
//! which decides, admits and starts the first try; this side then makes that try (connect, first-byte
//! and whole-answer deadlines, the response bound, a cut when the endpoint is ejected meanwhile) and
//! relays the answer, telling Python when its first byte came and how it ended. Everything else is
//! forwarded to the Python router's own HTTP app on a loopback port, unchanged: other paths, large or
//! encoded bodies, and a request whose first try failed before anything reached the client (Python
//! then goes on with its tries where this one left off, named by a one-use token in a header), so
//! there is one implementation of each rule that is not on the common path.
//!
//! Python is called with the GIL on this thread. Python's own calls here (``eject``, ``stop``) take
//! only a mutex or a notify, never the GIL or Python's router lock.

use std::collections::HashMap;
use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::http::request::Parts;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

/// The header that tells the Python app to go on with a request this side began.
const RESUME: &str = "x-kvstrata-resume";

/// Hop-by-hop headers (RFC 9110), dropped on every leg.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "te" | "trailers" | "transfer-encoding" | "upgrade"
    )
}

/// Dropped between client and engine both ways (proxy.py's ``_HOP_BY_HOP``): hyper sets framing and Host.
fn dropped_relayed(name: &HeaderName) -> bool {
    hop_by_hop(name)
        || matches!(
            name.as_str(),
            "proxy-authenticate" | "proxy-authorization" | "host" | "content-length"
        )
}

/// Request headers never forwarded to an engine (proxy.py's ``_REQ_DROP``).
fn dropped_upstream(name: &HeaderName) -> bool {
    dropped_relayed(name) || matches!(name.as_str(), "accept-encoding" | RESUME)
}

/// Response headers not relayed (proxy.py's ``_RESP_DROP``; hyper writes its own Date).
fn dropped_downstream(name: &HeaderName) -> bool {
    dropped_relayed(name) || matches!(name.as_str(), "date" | "server")
}

struct Limits {
    fast_body_bytes: u64,
    body_read_timeout: Duration,
    header_read_timeout: Duration,
    first_byte_timeout: Duration,
    upstream_timeout: Duration,
    stream_idle_timeout: Duration,
    max_response_bytes: usize,
}

/// What Python's ``begin`` (or a later ``reply.send``) says to do with a request.
enum Plan {
    /// Make one try on ``url``; ``handle`` names it in the calls that follow.
    Go {
        handle: Py<PyAny>,
        url: String,
        stream: bool,
        last: bool,
        headers: Vec<(String, String)>,
    },
    /// Answer the client with this (a refusal, an error).
    Answer {
        status: u16,
        body: Bytes,
        headers: Vec<(String, String)>,
    },
    /// Forward to the Python app with this token: it goes on from there.
    Resume { token: String },
}

/// proxy.py's ``Go``: (tag, handle, url, stream, last, headers).
type GoTuple = (String, Py<PyAny>, String, bool, bool, Vec<(String, String)>);

fn plan_of(obj: &Bound<'_, PyAny>) -> PyResult<Plan> {
    let tag: String = obj.get_item(0)?.extract()?;
    match tag.as_str() {
        "go" => {
            let (_, handle, url, stream, last, headers): GoTuple = obj.extract()?;
            Ok(Plan::Go {
                handle,
                url,
                stream,
                last,
                headers,
            })
        }
        "answer" => {
            let (_, status, body, headers): (String, u16, Vec<u8>, Vec<(String, String)>) =
                obj.extract()?;
            Ok(Plan::Answer {
                status,
                body: Bytes::from(body),
                headers,
            })
        }
        "resume" => {
            let (_, token): (String, String) = obj.extract()?;
            Ok(Plan::Resume { token })
        }
        other => Err(PyValueError::new_err(format!("unknown plan {other:?}"))),
    }
}

/// The answer to a ``begin`` that had to wait (an admission hold, a long prompt hashed in a pool),
/// sent from the event loop's thread.
#[pyclass(module = "kvstrata_native", frozen)]
pub struct Reply {
    tx: Mutex<Option<oneshot::Sender<Py<PyAny>>>>,
}

#[pymethods]
impl Reply {
    fn send(&self, plan: Py<PyAny>) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(plan);
        }
    }
}

/// A response body: whole, relayed from the loopback app, or an engine's stream relayed.
enum RespBody {
    Whole(Option<Bytes>),
    Loop(Incoming),
    Relay(Box<Relay>),
}

impl Body for RespBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RespBody::Whole(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::Loop(inc) => Pin::new(inc).poll_frame(cx),
            RespBody::Relay(r) => Pin::new(r.as_mut())
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|never: Infallible| match never {}))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Whole(b) => b.is_none(),
            RespBody::Loop(inc) => inc.is_end_stream(),
            RespBody::Relay(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Whole(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            RespBody::Loop(inc) => inc.size_hint(),
            RespBody::Relay(_) => SizeHint::default(),
        }
    }
}

type Resp = Response<RespBody>;
type LoopBody = BoxBody<Bytes, hyper::Error>;

fn empty() -> LoopBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

struct Inner {
    handler: Py<PyAny>,
    limits: Limits,
    session_header: Option<HeaderName>,
    client: Client<HttpConnector, Full<Bytes>>,
    loopback: Client<HttpConnector, LoopBody>,
    loopback_base: String,
    connections: Arc<Semaphore>,
    ejections: Mutex<HashMap<String, Arc<Notify>>>,
}

fn json_response(status: StatusCode, body: Bytes, headers: &[(String, String)]) -> Resp {
    let mut r = Response::new(RespBody::Whole(Some(body)));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    add_headers(h, headers);
    r
}

/// The response to a plan that should be an answer; the router's own 500 for anything else.
fn answered(plan: Option<Plan>, fallback: StatusCode) -> Resp {
    match plan {
        Some(Plan::Answer {
            status,
            body,
            headers,
        }) => json_response(
            StatusCode::from_u16(status).unwrap_or(fallback),
            body,
            &headers,
        ),
        _ => router_error("internal router error (logged)"),
    }
}

fn add_headers(h: &mut HeaderMap, headers: &[(String, String)]) {
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (
            HeaderName::try_from(k.as_str()),
            HeaderValue::try_from(v.as_str()),
        ) {
            if k != hyper::header::CONTENT_LENGTH {
                h.insert(k, v);
            }
        }
    }
}

/// The router's own failure, when Python could not be asked (it raised): the OpenAI shape, as
/// errors.py's ``json_error`` writes it.
fn router_error(message: &str) -> Resp {
    let body = format!(
        "{{\"error\": {{\"message\": \"{message}\", \"type\": \"server_error\", \"param\": null, \"code\": \"router_error\"}}}}"
    );
    json_response(StatusCode::INTERNAL_SERVER_ERROR, Bytes::from(body), &[])
}

/// Why a try failed before anything reached the client: outcomes.py's ``FailureKind`` values.
struct Fail {
    kind: &'static str,
    detail: String,
}

enum Got {
    Whole(hyper::http::response::Parts, Bytes),
    Stream(hyper::http::response::Parts, Bytes, Incoming),
    TooLarge,
}

fn classify(url: &str, e: &hyper_util::client::legacy::Error) -> Fail {
    let mut timed_out = false;
    let mut src: Option<&(dyn StdError + 'static)> = e.source();
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                timed_out = true;
            }
        }
        src = s.source();
    }
    let kind = if e.is_connect() && timed_out {
        "connect_timeout"
    } else if e.is_connect() {
        "connect_error"
    } else {
        "disconnected"
    };
    Fail {
        kind,
        detail: format!("{url}: {}", causes(e)),
    }
}

/// An error and its causes, as one line ("tcp connect error: Connection refused (os error 111)").
fn causes(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

impl Inner {
    /// ``handler.<name>(*args)`` with the GIL; a Python error is printed and returned as ``None``.
    fn call<'py, A>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, pyo3::types::PyString>,
        args: A,
    ) -> Option<Bound<'py, PyAny>>
    where
        A: pyo3::call::PyCallArgs<'py>,
    {
        match self.handler.bind(py).call_method1(name, args) {
            Ok(v) => Some(v),
            Err(e) => {
                e.print(py);
                None
            }
        }
    }

    /// ``handler.<name>(*args)`` read as a plan; None (printed) where Python raised or answered
    /// something else.
    fn call_plan<A>(&self, name: &str, args: A) -> Option<Plan>
    where
        A: for<'py> pyo3::call::PyCallArgs<'py>,
    {
        Python::attach(|py| {
            let name = pyo3::types::PyString::intern(py, name);
            self.call(py, &name, args)
                .and_then(|p| plan_of(&p).map_err(|e| e.print(py)).ok())
        })
    }

    fn ejection(&self, url: &str) -> Arc<Notify> {
        let mut map = self.ejections.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get(url) {
            return n.clone(); // every try looks its URL up: no key allocated but the first time
        }
        map.entry(url.to_owned())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Resp, Infallible> {
        let (mut parts, body) = req.into_parts();
        parts.headers.remove(RESUME); // only this side may name a request to go on with
        let kind = match (&parts.method, parts.uri.path()) {
            (&Method::POST, "/v1/completions") => Some("completion"),
            (&Method::POST, "/v1/chat/completions") => Some("chat"),
            _ => None,
        };
        let length = parts
            .headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let plain = parts
            .headers
            .get(hyper::header::CONTENT_ENCODING)
            .is_none_or(|v| v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let fast = match (kind, length) {
            (Some(kind), Some(n)) if plain && n <= self.limits.fast_body_bytes => Some(kind),
            _ => None,
        };
        let Some(kind) = fast else {
            return Ok(self.forward(&parts, body.boxed(), None).await);
        };
        let read = tokio::time::timeout(self.limits.body_read_timeout, body.collect()).await;
        let body = match read {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(_)) => return Ok(router_error("the request body could not be read")),
            Err(_) => {
                return Ok(answered(
                    self.call_plan("body_timeout", ()),
                    StatusCode::REQUEST_TIMEOUT,
                ))
            }
        };
        let plan = match self.begin(kind, &parts, &body).await {
            Some(p) => p,
            None => return Ok(router_error("internal router error (logged)")),
        };
        Ok(self.follow(plan, parts, body).await)
    }

    async fn begin(self: &Arc<Self>, kind: &str, parts: &Parts, body: &Bytes) -> Option<Plan> {
        let session = self
            .session_header
            .as_ref()
            .and_then(|h| parts.headers.get(h))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let (tx, rx) = oneshot::channel();
        let (now, reply) = Python::attach(|py| {
            let reply = Py::new(
                py,
                Reply {
                    tx: Mutex::new(Some(tx)),
                },
            )
            .ok()?;
            let got = self.call(
                py,
                intern!(py, "begin"),
                (
                    kind,
                    path,
                    PyBytes::new(py, body),
                    session,
                    reply.clone_ref(py),
                ),
            )?;
            if got.is_none() {
                return Some((None, reply));
            }
            Some((Some(plan_of(&got).map_err(|e| e.print(py)).ok()?), reply))
        })?;
        if let Some(plan) = now {
            return Some(plan);
        }
        let mut waiting = Waiting {
            inner: self.clone(),
            reply: Some(reply),
            rx,
        };
        let later = (&mut waiting.rx).await.ok()?;
        waiting.reply = None;
        Python::attach(|py| plan_of(later.bind(py)).map_err(|e| e.print(py)).ok())
    }

    async fn follow(self: &Arc<Self>, plan: Plan, parts: Parts, body: Bytes) -> Resp {
        match plan {
            answer @ Plan::Answer { .. } => {
                answered(Some(answer), StatusCode::INTERNAL_SERVER_ERROR)
            }
            Plan::Resume { token } => self.forward(&parts, empty(), Some(token)).await,
            Plan::Go {
                handle,
                url,
                stream,
                last,
                headers,
            } => {
                self.go(&parts, body, handle, url, stream, last, headers)
                    .await
            }
        }
    }

    /// One try on ``url``, as proxy.py's ``_exchange`` makes it.
    #[allow(clippy::too_many_arguments)]
    async fn go(
        self: &Arc<Self>,
        parts: &Parts,
        body: Bytes,
        handle: Py<PyAny>,
        url: String,
        stream: bool,
        last: bool,
        decision_headers: Vec<(String, String)>,
    ) -> Resp {
        let mut guard = TryGuard {
            inner: self.clone(),
            handle: Some(handle),
        };
        let t0 = Instant::now();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut up = Request::builder()
            .method(parts.method.clone())
            .uri(format!("{url}{path}"));
        if let Some(h) = up.headers_mut() {
            for (k, v) in &parts.headers {
                if !dropped_upstream(k) {
                    h.append(k.clone(), v.clone());
                }
            }
            h.insert(
                hyper::header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        let Ok(req) = up.body(Full::new(body)) else {
            return self
                .end_failed(
                    parts,
                    guard,
                    Fail {
                        kind: "connect_error",
                        detail: format!("{url}: not a valid URL"),
                    },
                )
                .await;
        };
        let deadline = if stream {
            self.limits.first_byte_timeout
        } else {
            self.limits.upstream_timeout
        };
        let ejected = self.ejection(&url);
        let cut = ejected.notified();
        tokio::pin!(cut);
        cut.as_mut().enable();
        let max = self.limits.max_response_bytes;
        let connections = self.connections.clone();
        let work = async {
            let permit = connections.acquire_owned().await.map_err(|_| Fail {
                kind: "connect_error",
                detail: "the router is stopping".into(),
            })?;
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| classify(&url, &e))?;
            let status = resp.status();
            if status.as_u16() >= 500 && !last {
                return Err(Fail {
                    kind: "upstream_5xx",
                    detail: format!("{url} answered {}", status.as_u16()),
                });
            }
            let (rparts, mut inc) = resp.into_parts();
            if stream && status == StatusCode::OK {
                loop {
                    match inc.frame().await {
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                if !d.is_empty() {
                                    return Ok((Got::Stream(rparts, d, inc), permit));
                                }
                            }
                        }
                        Some(Err(e)) => {
                            return Err(Fail {
                                kind: "disconnected",
                                detail: format!("{url}: {}", causes(&e)),
                            })
                        }
                        None => {
                            return Err(Fail {
                                kind: "disconnected",
                                detail: format!("{url} ended the stream before its first byte"),
                            })
                        }
                    }
                }
            }
            let too_large = rparts
                .headers
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok())
                .is_some_and(|n| n > max);
            if too_large {
                return Ok((Got::TooLarge, permit));
            }
            match Limited::new(inc, max).collect().await {
                Ok(c) => Ok((Got::Whole(rparts, c.to_bytes()), permit)),
                Err(e) if e.is::<LengthLimitError>() => Ok((Got::TooLarge, permit)),
                Err(e) => Err(Fail {
                    kind: "disconnected",
                    detail: format!("{url}: {}", causes(e.as_ref())),
                }),
            }
        };
        let got = tokio::select! {
            r = work => r,
            () = tokio::time::sleep(deadline) => Err(Fail {
                kind: if stream { "first_byte_timeout" } else { "response_timeout" },
                detail: format!("{url} did not answer within {}s", deadline.as_secs_f64()),
            }),
            () = &mut cut => Err(Fail { kind: "ejected", detail: format!("{url} was ejected while the request waited") }),
        };
        let upstream_ms = || t0.elapsed().as_millis().to_string();
        match got {
            Err(fail) if fail.kind == "response_timeout" => {
                self.broke(guard, "response_timeout", &fail.detail)
            }
            Err(fail) => self.end_failed(parts, guard, fail).await,
            Ok((Got::TooLarge, _)) => self.broke(guard, "response_too_large", ""),
            Ok((Got::Whole(rparts, body), _permit)) => {
                let status = rparts.status;
                let outcome = if status.as_u16() < 400 {
                    "ok"
                } else if status.as_u16() < 500 {
                    "http_4xx"
                } else {
                    "http_5xx"
                };
                let mut out = Response::new(RespBody::Whole(None));
                *out.status_mut() = status;
                relay_headers(out.headers_mut(), &rparts.headers);
                add_headers(out.headers_mut(), &decision_headers);
                add_attempt_headers(out.headers_mut(), &upstream_ms());
                let handle = guard.handle.take();
                Python::attach(|py| {
                    self.call(
                        py,
                        intern!(py, "done"),
                        (handle, outcome, PyBytes::new(py, &body)),
                    );
                });
                *out.body_mut() = RespBody::Whole(Some(body));
                out
            }
            Ok((Got::Stream(rparts, first, inc), permit)) => {
                let handle = guard.handle.take();
                Python::attach(|py| {
                    self.call(py, intern!(py, "first"), (handle.as_ref(),));
                });
                let idle = self.limits.stream_idle_timeout;
                let relay = Relay {
                    inner: self.clone(),
                    handle,
                    first: Some(first),
                    up: inc,
                    idle: Box::pin(tokio::time::sleep(idle)),
                    idle_for: idle,
                    tail: None,
                    done: false,
                    heard: Instant::now(),
                    _permit: permit,
                };
                let mut out = Response::new(RespBody::Relay(Box::new(relay)));
                *out.status_mut() = rparts.status;
                relay_headers(out.headers_mut(), &rparts.headers);
                add_headers(out.headers_mut(), &decision_headers);
                add_attempt_headers(out.headers_mut(), &upstream_ms());
                out
            }
        }
    }

    /// A try that failed before anything reached the client: Python counts it and names the request
    /// to go on with, which the loopback app then takes over.
    async fn end_failed(self: &Arc<Self>, parts: &Parts, mut guard: TryGuard, fail: Fail) -> Resp {
        let handle = guard.handle.take();
        match self.call_plan("failed", (handle, fail.kind, fail.detail)) {
            // The body is Python's to resend (it kept it): the app is sent the request line, the
            // headers and the token.
            Some(Plan::Resume { token }) => self.forward(parts, empty(), Some(token)).await,
            other => answered(other, StatusCode::BAD_GATEWAY),
        }
    }

    /// The try's end that Python answers for (a timeout, a response over the bound): its response.
    fn broke(&self, mut guard: TryGuard, outcome: &str, detail: &str) -> Resp {
        let handle = guard.handle.take();
        answered(
            self.call_plan("broke", (handle, outcome, detail)),
            StatusCode::BAD_GATEWAY,
        )
    }

    /// A request to the loopback app, streamed both ways; with a token, Python goes on with it.
    async fn forward(
        self: &Arc<Self>,
        parts: &Parts,
        body: LoopBody,
        token: Option<String>,
    ) -> Resp {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut up = Request::builder()
            .method(parts.method.clone())
            .uri(format!("{}{}", self.loopback_base, path));
        if let Some(h) = up.headers_mut() {
            for (k, v) in &parts.headers {
                // With a token the body is empty: the app kept the request's own.
                let length = k == hyper::header::CONTENT_LENGTH;
                if !(hop_by_hop(k) || token.is_some() && length) {
                    h.append(k.clone(), v.clone());
                }
            }
            if let Some(t) = &token {
                if let Ok(v) = HeaderValue::try_from(t.as_str()) {
                    h.insert(RESUME, v);
                }
            }
        }
        let Ok(req) = up.body(body) else {
            return router_error("the request could not be forwarded");
        };
        self.send_loop(req, token).await
    }

    async fn send_loop(self: &Arc<Self>, req: Request<LoopBody>, token: Option<String>) -> Resp {
        let mut pending = Pending {
            inner: self.clone(),
            token,
        };
        match self.loopback.request(req).await {
            Ok(resp) => {
                pending.token = None; // the app has it (it answers only after taking it)
                let (rparts, inc) = resp.into_parts();
                let mut out = Response::new(RespBody::Loop(inc));
                *out.status_mut() = rparts.status;
                for (k, v) in &rparts.headers {
                    if !hop_by_hop(k) && k != hyper::header::CONTENT_LENGTH {
                        out.headers_mut().append(k.clone(), v.clone());
                    }
                }
                out
            }
            Err(_) => router_error("the router's own app did not answer"),
        }
    }
}

fn relay_headers(out: &mut HeaderMap, from: &HeaderMap) {
    for (k, v) in from {
        if !dropped_downstream(k) {
            out.append(k.clone(), v.clone());
        }
    }
}

fn add_attempt_headers(h: &mut HeaderMap, upstream_ms: &str) {
    h.insert("x-kvstrata-attempts", HeaderValue::from_static("1"));
    if let Ok(v) = HeaderValue::try_from(upstream_ms) {
        h.insert("x-kvstrata-upstream-ms", v);
    }
}

/// A try in flight whose client may go away before its response: Python hears of it once.
struct TryGuard {
    inner: Arc<Inner>,
    handle: Option<Py<PyAny>>,
}

impl Drop for TryGuard {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            Python::attach(|py| {
                self.inner
                    .call(py, intern!(py, "done"), (h, "client_disconnect", py.None()));
            });
        }
    }
}

/// A plan being made on the event loop for a client that may leave first: Python cancels it, and
/// gives back what a plan made meanwhile took.
struct Waiting {
    inner: Arc<Inner>,
    reply: Option<Py<Reply>>,
    rx: oneshot::Receiver<Py<PyAny>>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            Python::attach(|py| {
                self.inner.call(py, intern!(py, "cancel"), (reply,));
                if let Ok(plan) = self.rx.try_recv() {
                    self.inner.call(py, intern!(py, "undo"), (plan,));
                }
            });
        }
    }
}

/// A token handed to the loopback app that the app may not have taken yet.
struct Pending {
    inner: Arc<Inner>,
    token: Option<String>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(t) = self.token.take() {
            Python::attach(|py| {
                self.inner.call(py, intern!(py, "abandon"), (t,));
            });
        }
    }
}

/// An engine's stream, relayed: at most ``stream_idle_timeout`` between chunks; a stream that breaks
/// ends with Python's SSE error event.
struct Relay {
    inner: Arc<Inner>,
    handle: Option<Py<PyAny>>,
    first: Option<Bytes>,
    up: Incoming,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_for: Duration,
    tail: Option<Bytes>,
    done: bool,
    heard: Instant,
    _permit: OwnedSemaphorePermit,
}

/// How often a moving stream tells Python its engine was heard from (patience.py reads it).
const HEARD_EVERY: Duration = Duration::from_millis(500);

impl Relay {
    fn abort(
        &mut self,
        outcome: &str,
        detail: String,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.done = true;
        let handle = self.handle.take();
        let event = Python::attach(|py| {
            self.inner
                .call(py, intern!(py, "broke"), (handle, outcome, detail))
                .and_then(|b| b.extract::<Vec<u8>>().ok())
        });
        match event {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(b))))),
            None => Poll::Ready(None),
        }
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(b) = this.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if let Some(t) = this.tail.take() {
            return Poll::Ready(Some(Ok(Frame::data(t))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.up).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => {
                    let Ok(d) = f.into_data() else { continue };
                    let now = tokio::time::Instant::now();
                    this.idle.as_mut().reset(now + this.idle_for);
                    if this.heard.elapsed() >= HEARD_EVERY {
                        this.heard = Instant::now();
                        if let Some(h) = &this.handle {
                            Python::attach(|py| {
                                this.inner.call(py, intern!(py, "heard"), (h,));
                            });
                        }
                    }
                    if d.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Poll::Ready(Some(Err(e))) => return this.abort("stream_aborted", causes(&e)),
                Poll::Ready(None) => {
                    this.done = true;
                    if let Some(h) = this.handle.take() {
                        Python::attach(|py| {
                            this.inner
                                .call(py, intern!(py, "done"), (h, "stream_ok", py.None()));
                        });
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if this.idle.as_mut().poll(cx).is_ready() {
                        return this.abort("stream_idle_timeout", String::new());
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            Python::attach(|py| {
                self.inner
                    .call(py, intern!(py, "done"), (h, "client_disconnect", py.None()));
            });
        }
    }
}

/// The native HTTP front: bound when made (so the port is known and errors surface at once), served
/// by ``serve`` on the calling thread until ``stop``.
#[pyclass(module = "kvstrata_native", frozen)]
pub struct Front {
    inner: Arc<Inner>,
    listener: Mutex<Option<std::net::TcpListener>>,
    stop: Arc<Notify>,
    #[pyo3(get)]
    port: u16,
}

#[pymethods]
impl Front {
    #[new]
    #[pyo3(signature = (
        host, port, loopback_port, handler, *, session_header, fast_body_bytes, body_read_timeout,
        header_read_timeout, connect_timeout, first_byte_timeout, upstream_timeout,
        stream_idle_timeout, max_response_bytes, max_connections
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        host: &str,
        port: u16,
        loopback_port: u16,
        handler: Py<PyAny>,
        session_header: Option<String>,
        fast_body_bytes: u64,
        body_read_timeout: f64,
        header_read_timeout: f64,
        connect_timeout: f64,
        first_byte_timeout: f64,
        upstream_timeout: f64,
        stream_idle_timeout: f64,
        max_response_bytes: usize,
        max_connections: usize,
    ) -> PyResult<Self> {
        let addr: SocketAddr = (host, port)
            .to_socket_addrs()
            .map_err(|e| PyOSError::new_err(e.to_string()))?
            .next()
            .ok_or_else(|| PyOSError::new_err(format!("no address for {host}")))?;
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )
        .map_err(|e| PyOSError::new_err(e.to_string()))?;
        let bind = || -> std::io::Result<std::net::TcpListener> {
            socket.set_reuse_address(true)?;
            socket.bind(&addr.into())?;
            socket.listen(4096)?;
            socket.set_nonblocking(true)?;
            Ok(socket.try_clone()?.into())
        };
        let listener = bind().map_err(|e| PyOSError::new_err(format!("{addr}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| PyOSError::new_err(e.to_string()))?
            .port();
        let secs = Duration::from_secs_f64;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(secs(connect_timeout)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_timer(TokioTimer::new())
            .build(connector);
        let mut local = HttpConnector::new();
        local.set_nodelay(true);
        let loopback = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_timer(TokioTimer::new())
            .build(local);
        let session_header = session_header
            .map(|h| HeaderName::try_from(h.to_ascii_lowercase()))
            .transpose()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let inner = Inner {
            handler,
            limits: Limits {
                fast_body_bytes,
                body_read_timeout: secs(body_read_timeout),
                header_read_timeout: secs(header_read_timeout),
                first_byte_timeout: secs(first_byte_timeout),
                upstream_timeout: secs(upstream_timeout),
                stream_idle_timeout: secs(stream_idle_timeout),
                max_response_bytes,
            },
            session_header,
            client,
            loopback,
            loopback_base: format!("http://127.0.0.1:{loopback_port}"),
            connections: Arc::new(Semaphore::new(max_connections.max(1))),
            ejections: Mutex::new(HashMap::new()),
        };
        Ok(Front {
            inner: Arc::new(inner),
            listener: Mutex::new(Some(listener)),
            stop: Arc::new(Notify::new()),
            port,
        })
    }

    /// Serves on the calling thread until :meth:`stop`; the GIL is held only while Python is called.
    fn serve(&self, py: Python<'_>) -> PyResult<()> {
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("already served"))?;
        let inner = self.inner.clone();
        let stop = self.stop.clone();
        py.detach(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(run(listener, inner, stop))
        })
        .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// Ends :meth:`serve` (from any thread): the listener closes and requests in flight are dropped.
    fn stop(&self) {
        self.stop.notify_one();
    }

    /// Cuts the first-byte waits of tries on ``url`` (it was ejected): they fail as ``ejected``.
    fn eject(&self, url: &str) {
        let map = self
            .inner
            .ejections
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get(url) {
            n.notify_waiters();
        }
    }
}

async fn run(
    listener: std::net::TcpListener,
    inner: Arc<Inner>,
    stop: Arc<Notify>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let header_read = inner.limits.header_read_timeout;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = stop.notified() => return Ok(()),
        };
        let Ok((stream, _)) = accepted else { continue };
        let _ = stream.set_nodelay(true);
        let inner = inner.clone();
        tokio::spawn(async move {
            let handler = inner.clone();
            let service = service_fn(move |req| handler.clone().handle(req));
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                if e.is_parse() || e.is_parse_too_large() {
                    // hyper answered 400 (431 for a head too large); counted under the Python app's
                    // names for the same refusals.
                    let error = if e.is_parse_too_large() {
                        "LineTooLong"
                    } else {
                        "BadHttpMessage"
                    };
                    Python::attach(|py| {
                        inner.call(py, intern!(py, "malformed"), (error,));
                    });
                }
            }
        });
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Front>()?;
    m.add_class::<Reply>()?;
    Ok(())
}
