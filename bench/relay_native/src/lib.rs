//! `make bench-relay-floor`'s native relays: what a router's HTTP path costs when it is not Python.
//!
//! One tokio thread (a current-thread runtime, as the Python relays have one event loop) runs a hyper
//! HTTP/1.1 server and a kept-alive hyper client to the upstreams. Each request is forwarded whole and
//! its response returned whole (bench-proxy's json mode). With ``decide``, every request first asks
//! Python which upstream to take (one GIL acquisition, the body passed as bytes) and, with ``end``,
//! tells Python when its answer is back (another): the cost of keeping the router's decision in Python
//! behind a native HTTP path. With ``submit`` instead, the tokio thread only hands each request to
//! Python (``submit(body, reply)``, which queues it on an event loop in another thread) and waits for
//! ``reply.send``: the decision runs on the event loop, as the router's does today.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{header, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// How each request's upstream is chosen.
enum Chooser {
    RoundRobin(AtomicUsize),
    /// ``decide(body) -> (index, ticket)``, called on the tokio thread.
    Decide(Py<PyAny>),
    /// ``submit(body, reply)``; the answer comes back through ``reply.send(index, ticket)``.
    Submit(Py<PyAny>),
}

struct Relay {
    upstreams: Vec<String>,
    client: Client<HttpConnector, Full<Bytes>>,
    chooser: Chooser,
    end: Option<Py<PyAny>>,
}

/// A request's upstream index and Python's ticket for ``end``.
type Answer = (usize, Py<PyAny>);

/// The answer to one submitted request, sent from Python (any thread) to the waiting tokio task.
#[pyclass(module = "kvstrata_relay_native", frozen)]
struct Reply {
    tx: Mutex<Option<oneshot::Sender<Answer>>>,
}

#[pymethods]
impl Reply {
    fn send(&self, index: usize, ticket: Py<PyAny>) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send((index, ticket));
        }
    }
}

fn reply(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

impl Relay {
    /// (upstream index, Python's ticket for ``end``).
    async fn choose(&self, body: &Bytes) -> PyResult<(usize, Option<Py<PyAny>>)> {
        match &self.chooser {
            Chooser::RoundRobin(next) => Ok((next.fetch_add(1, Ordering::Relaxed), None)),
            Chooser::Decide(decide) => Python::attach(|py| {
                let got = decide.call1(py, (PyBytes::new(py, body),))?;
                let (i, ticket): Answer = got.extract(py)?;
                Ok((i, Some(ticket)))
            }),
            Chooser::Submit(submit) => {
                let (tx, rx) = oneshot::channel();
                Python::attach(|py| {
                    let answer = Reply {
                        tx: Mutex::new(Some(tx)),
                    };
                    submit
                        .call1(py, (PyBytes::new(py, body), answer))
                        .map(|_| ())
                })?;
                let (i, ticket) = rx.await.map_err(|_| PyRuntimeError::new_err("no reply"))?;
                Ok((i, Some(ticket)))
            }
        }
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        let path = req.uri().path().to_owned();
        let body = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, Bytes::new())),
        };
        let (i, ticket) = match self.choose(&body).await {
            Ok(c) => c,
            Err(e) => {
                return Ok(reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Bytes::from(e.to_string()),
                ))
            }
        };
        let uri = format!("{}{}", self.upstreams[i % self.upstreams.len()], path);
        let up = Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .expect("a valid request");
        let out = match self.client.request(up).await {
            Ok(resp) => {
                let status = resp.status();
                match resp.into_body().collect().await {
                    Ok(b) => reply(status, b.to_bytes()),
                    Err(_) => reply(StatusCode::BAD_GATEWAY, Bytes::new()),
                }
            }
            Err(_) => reply(StatusCode::BAD_GATEWAY, Bytes::new()),
        };
        if let (Some(end), Some(ticket)) = (&self.end, ticket) {
            Python::attach(|py| {
                if let Err(e) = end.call1(py, (ticket,)) {
                    e.print(py);
                }
            });
        }
        Ok(out)
    }
}

async fn run(port: u16, relay: Arc<Relay>) -> std::io::Result<()> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let relay = relay.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| relay.clone().handle(req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Serves until the process ends: forwards every request to ``upstreams`` (round-robin; or the index
/// ``decide(body)`` returns, or ``submit(body, reply)`` sends back, with a ticket handed to
/// ``end(ticket)`` once the answer is back).
#[pyfunction]
#[pyo3(signature = (port, upstreams, decide = None, end = None, submit = None))]
fn serve(
    py: Python<'_>,
    port: u16,
    upstreams: Vec<String>,
    decide: Option<Py<PyAny>>,
    end: Option<Py<PyAny>>,
    submit: Option<Py<PyAny>>,
) -> PyResult<()> {
    let chooser = match (decide, submit) {
        (Some(d), _) => Chooser::Decide(d),
        (None, Some(s)) => Chooser::Submit(s),
        (None, None) => Chooser::RoundRobin(AtomicUsize::new(0)),
    };
    let relay = Arc::new(Relay {
        upstreams,
        client: Client::builder(TokioExecutor::new()).build_http(),
        chooser,
        end,
    });
    py.detach(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(run(port, relay))
    })
    .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

#[pymodule]
fn kvstrata_relay_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_class::<Reply>()?;
    Ok(())
}
