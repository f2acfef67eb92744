//! The kv-aware ranking of router/scoring.py's built-in scorers in one native call: the scores, their
//! weighted totals and the order `pick` gives, read straight from the router's Python objects (the
//! endpoints, the request, the scorers' own state).
//!
//! `scoring.py` stays the definition: every formula here is its Python twin's, term for term, in the
//! same order of operations (so the same floats), with Python's `max`/`min` (the first argument wins
//! a tie or a NaN) and `round` (correctly rounded, as Rust's exact formatting is). The parity test
//! (tests/unit/router/test_router_native_pick.py) replays random requests through both.

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::Recency;

// Scorer kinds, as router/scoring.py's NativePick names them.
const PREFILL: u8 = 0;
const PREFIX: u8 = 1;
const LOAD: u8 = 2;
const KV_USAGE: u8 = 3;
const CACHE_ROOM: u8 = 4;
const HISTORY: u8 = 5;
const FIT: u8 = 6;
const RECENT: u8 = 7;
const EVICTS: u8 = 8;
const SESSION: u8 = 9;

/// Python's `max(a, b)`: `b` only when it is strictly greater.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Python's `min(a, b)`: `b` only when it is strictly less.
fn py_min(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}

/// Python's `round(x, 9)`: the exact value rounded half-even to nine decimals, then the nearest float.
fn round9(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    format!("{x:.9}").parse().unwrap_or(x)
}

/// `pool.faded`.
fn faded(value: f64, age: f64, window: f64) -> f64 {
    if window > 0.0 {
        value * (-py_max(age, 0.0) / window).exp()
    } else {
        0.0
    }
}

/// `scoring.rendezvous`: blake2b with an 8-byte digest of key + url, big-endian.
pub fn rendezvous(key: &[u8], url: &[u8]) -> u64 {
    let mut h = Blake2bVar::new(8).expect("8 bytes is a blake2b digest size");
    h.update(key);
    h.update(url);
    let mut out = [0u8; 8];
    h.finalize_variable(&mut out)
        .expect("the buffer is the digest's size");
    u64::from_be_bytes(out)
}

/// A `PrefixMatch`: blocks, gpu, cpu, storage, predicted.
type Match = (i64, i64, i64, i64, i64);

struct Ep<'py> {
    url: Bound<'py, PyString>,
    pending_prefill: f64,
    load: f64,
    kv_usage: f64,
    kv_blocks: i64,
    matched: Option<Match>,
}

struct Req<'py> {
    n_hashes: i64,
    block_count: i64,
    prompt_tokens: Option<i64>,
    matches: Bound<'py, PyDict>,
    history: Bound<'py, PyDict>,
    cached_blocks: Bound<'py, PyDict>,
    growth: Bound<'py, PyDict>,
    with_room: Bound<'py, PyAny>,
    now: f64,
    approximate: bool,
    session: Option<String>,
    tie_key: Bound<'py, PyBytes>,
}

impl<'py> Req<'py> {
    fn read(req: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = req.py();
        let n_hashes = req.getattr(intern!(py, "hashes"))?.len()? as i64;
        let blocks: Option<i64> = req.getattr(intern!(py, "blocks"))?.extract()?;
        Ok(Self {
            n_hashes,
            block_count: blocks.unwrap_or(n_hashes),
            prompt_tokens: req.getattr(intern!(py, "prompt_tokens"))?.extract()?,
            matches: req.getattr(intern!(py, "matches"))?.downcast_into()?,
            history: req.getattr(intern!(py, "history"))?.downcast_into()?,
            cached_blocks: req.getattr(intern!(py, "cached_blocks"))?.downcast_into()?,
            growth: req.getattr(intern!(py, "growth"))?.downcast_into()?,
            with_room: req.getattr(intern!(py, "with_room"))?,
            now: req.getattr(intern!(py, "now"))?.extract()?,
            approximate: req.getattr(intern!(py, "approximate"))?.is_truthy()?,
            session: req.getattr(intern!(py, "session"))?.extract()?,
            tie_key: req.getattr(intern!(py, "tie_key"))?.downcast_into()?,
        })
    }
}

fn read_eps<'py>(eps: &Bound<'py, PyList>, req: &Req<'py>) -> PyResult<Vec<Ep<'py>>> {
    let py = eps.py();
    let mut out = Vec::with_capacity(eps.len());
    for ep in eps.iter() {
        let url: Bound<'py, PyString> = ep.getattr(intern!(py, "url"))?.downcast_into()?;
        let in_flight: i64 = ep.getattr(intern!(py, "in_flight"))?.extract()?;
        let running: f64 = ep.getattr(intern!(py, "running"))?.extract()?;
        let waiting: f64 = ep.getattr(intern!(py, "waiting"))?.extract()?;
        let pending: i64 = ep.getattr(intern!(py, "pending_prefill"))?.extract()?;
        let matched = match req.matches.get_item(&url)? {
            Some(m) => Some(m.extract::<Match>()?),
            None => None,
        };
        out.push(Ep {
            pending_prefill: pending as f64,
            load: py_max(in_flight as f64, running) + waiting,
            kv_usage: ep.getattr(intern!(py, "kv_usage"))?.extract()?,
            kv_blocks: ep.getattr(intern!(py, "kv_blocks"))?.extract()?,
            matched,
            url,
        });
    }
    Ok(out)
}

/// `credited_blocks`.
fn credited(m: &Match, tiers: (f64, f64, f64)) -> f64 {
    let (_, gpu, cpu, storage, predicted) = *m;
    (gpu + predicted) as f64 * tiers.0 + cpu as f64 * tiers.1 + storage as f64 * tiers.2
}

/// `uncached_tokens`.
fn uncached(prompt_tokens: Option<i64>, blocks: i64, credit: f64, block_size: f64) -> f64 {
    match prompt_tokens {
        None => py_max(blocks as f64 - credit, 0.0) * block_size,
        Some(n) => py_max(n as f64 - credit * block_size, 1.0),
    }
}

fn int_at(d: &Bound<'_, PyDict>, url: &Bound<'_, PyString>) -> PyResult<i64> {
    d.get_item(url)?.map_or(Ok(0), |v| v.extract())
}

/// "Silent" scorers (every score equal) give all zeros.
fn zero_if_alike(scores: Vec<f64>) -> Vec<f64> {
    if scores.iter().all(|&s| s == scores[0]) {
        vec![0.0; scores.len()]
    } else {
        scores
    }
}

fn param(params: &[f64], i: usize) -> PyResult<f64> {
    params
        .get(i)
        .copied()
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("a scorer spec lacks a parameter"))
}

fn state_at<'py>(
    state: &Bound<'py, PyAny>,
    url: &Bound<'py, PyString>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    state.downcast::<PyDict>()?.get_item(url)
}

fn score(
    kind: u8,
    params: &[f64],
    state: &Bound<'_, PyAny>,
    req: &Req<'_>,
    eps: &[Ep<'_>],
) -> PyResult<Vec<f64>> {
    let n = eps.len();
    let zeros = || vec![0.0; n];
    Ok(match kind {
        PREFILL => {
            let tiers = (param(params, 0)?, param(params, 1)?, param(params, 2)?);
            let (block_size, queue_weight) = (param(params, 3)?, param(params, 4)?);
            let room_aware = param(params, 5)? != 0.0;
            let mut costs = Vec::with_capacity(n);
            for ep in eps {
                let credit = ep.matched.as_ref().map_or(0.0, |m| credited(m, tiers));
                let own = uncached(req.prompt_tokens, req.n_hashes, credit, block_size);
                costs.push(if room_aware && queue_weight > 0.0 {
                    let evicts = if req.with_room.contains(&ep.url)? {
                        1.0
                    } else {
                        1.0 / queue_weight
                    };
                    own * evicts + ep.pending_prefill
                } else {
                    own + queue_weight * ep.pending_prefill
                });
            }
            let cheapest = costs.iter().copied().reduce(py_min).unwrap_or(0.0);
            costs.iter().map(|c| (cheapest + 1.0) / (c + 1.0)).collect()
        }
        PREFIX => {
            let tiers = (param(params, 0)?, param(params, 1)?, param(params, 2)?);
            let top = py_max(py_max(tiers.0, tiers.1), tiers.2);
            if req.block_count == 0 || top <= 0.0 {
                return Ok(zeros());
            }
            let none = (0, 0, 0, 0, 0);
            let whole = req.block_count as f64 * top;
            eps.iter()
                .map(|ep| credited(ep.matched.as_ref().unwrap_or(&none), tiers) / whole)
                .collect()
        }
        LOAD => {
            let worst = eps.iter().map(|ep| ep.load).reduce(py_max).unwrap_or(0.0);
            eps.iter().map(|ep| 1.0 - ep.load / (worst + 1.0)).collect()
        }
        KV_USAGE => eps
            .iter()
            .map(|ep| 1.0 - py_min(py_max(ep.kv_usage, 0.0), 1.0))
            .collect(),
        CACHE_ROOM => {
            if !req.matches.is_empty() || !req.history.is_empty() || req.cached_blocks.is_empty() {
                return Ok(zeros());
            }
            let blocks = eps
                .iter()
                .map(|ep| int_at(&req.cached_blocks, &ep.url))
                .collect::<PyResult<Vec<_>>>()?;
            let most = blocks.iter().copied().max().unwrap_or(0);
            blocks
                .iter()
                .map(|&b| 1.0 - b as f64 / (most + 1) as f64)
                .collect()
        }
        HISTORY => {
            if !req.matches.is_empty() || req.history.is_empty() {
                return Ok(zeros());
            }
            let mut longest: Option<i64> = None;
            for (_, v) in req.history.iter() {
                let v: i64 = v.extract()?;
                longest = Some(longest.map_or(v, |l| l.max(v)));
            }
            let longest = longest.unwrap_or(1) as f64;
            eps.iter()
                .map(|ep| Ok(int_at(&req.history, &ep.url)? as f64 / longest))
                .collect::<PyResult<Vec<_>>>()?
        }
        FIT => {
            if req.n_hashes == 0 || eps.iter().any(|ep| ep.kv_blocks <= 0) {
                return Ok(zeros());
            }
            let horizon = req.now - param(params, 0)?;
            let mut scores = Vec::with_capacity(n);
            for ep in eps {
                let demand = match state_at(state, &ep.url)? {
                    None => 0,
                    Some(r) => r.downcast::<Recency>()?.borrow_mut().expire_before(horizon) as i64,
                };
                let growth: f64 = req
                    .growth
                    .get_item(&ep.url)?
                    .map_or(Ok(0.0), |g| g.extract())?;
                let added = req.block_count - ep.matched.as_ref().map_or(0, |m| m.0);
                scores.push(
                    if demand as f64 + growth + added as f64 <= ep.kv_blocks as f64 {
                        1.0
                    } else if demand > ep.kv_blocks {
                        0.5
                    } else {
                        0.0
                    },
                );
            }
            zero_if_alike(scores)
        }
        RECENT => {
            if !req.matches.is_empty() || !req.history.is_empty() {
                return Ok(zeros());
            }
            let window = param(params, 0)?;
            let mut recent = Vec::with_capacity(n);
            for ep in eps {
                let (value, at): (f64, f64) = match state_at(state, &ep.url)? {
                    Some(sent) => sent.extract()?,
                    None => (0.0, req.now),
                };
                recent.push(faded(value, req.now - at, window));
            }
            let most = recent.iter().copied().reduce(py_max).unwrap_or(0.0);
            recent.iter().map(|r| 1.0 - r / (most + 1.0)).collect()
        }
        EVICTS => {
            if !req.matches.is_empty()
                || req.approximate
                || req.n_hashes == 0
                || eps.iter().any(|ep| ep.kv_blocks <= 0)
            {
                return Ok(zeros());
            }
            let window = param(params, 0)?;
            let mut scores = Vec::with_capacity(n);
            for ep in eps {
                let age = match state_at(state, &ep.url)? {
                    None => f64::INFINITY,
                    Some(used) => {
                        let rank = (ep.kv_blocks - req.block_count).max(0) as usize;
                        match used.downcast::<Recency>()?.borrow().touched_at_rank(rank) {
                            None => f64::INFINITY,
                            Some(at) => req.now - at,
                        }
                    }
                };
                scores.push(1.0 - faded(1.0, age, window));
            }
            zero_if_alike(scores)
        }
        SESSION => {
            let Some(session) = req.session.as_deref().filter(|s| !s.is_empty()) else {
                return Ok(zeros());
            };
            let mut best: Option<(usize, u64)> = None;
            for (i, ep) in eps.iter().enumerate() {
                let h = rendezvous(session.as_bytes(), ep.url.to_str()?.as_bytes());
                if best.is_none_or(|(_, top)| h > top) {
                    best = Some((i, h));
                }
            }
            (0..n)
                .map(|i| {
                    if best.map(|b| b.0) == Some(i) {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect()
        }
        _ => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "no native scorer {kind}"
            )))
        }
    })
}

/// One weighted scorer as router/scoring.py's NativePick describes it.
struct Spec {
    kind: u8,
    weight: f64,
    params: Vec<f64>,
    state: Py<PyAny>, // the scorer's per-endpoint state (a dict), or None
}

/// `scoring.pick` for a fixed list of built-in scorers, ``[(kind, weight, params, state)]`` (weights
/// > 0, in the scorers' order), read once.
#[pyclass(module = "kvstrata_native", frozen)]
pub struct Ranker {
    specs: Vec<Spec>,
}

#[pymethods]
impl Ranker {
    #[new]
    fn new(specs: Vec<(u8, f64, Vec<f64>, Py<PyAny>)>) -> Self {
        let specs = specs
            .into_iter()
            .map(|(kind, weight, params, state)| Spec {
                kind,
                weight,
                params,
                state,
            })
            .collect();
        Self { specs }
    }

    /// The endpoints' indices best first, and per endpoint (in ``eps``' order) its total and its score
    /// from each scorer.
    #[allow(clippy::type_complexity)]
    fn rank(
        &self,
        req: &Bound<'_, PyAny>,
        eps: &Bound<'_, PyList>,
    ) -> PyResult<(Vec<usize>, Vec<f64>, Vec<Vec<f64>>)> {
        let py = req.py();
        let r = Req::read(req)?;
        let endpoints = read_eps(eps, &r)?;
        let n = endpoints.len();
        let mut totals = vec![0.0; n];
        let mut rows = vec![Vec::with_capacity(self.specs.len()); n];
        for spec in &self.specs {
            let scores = score(spec.kind, &spec.params, spec.state.bind(py), &r, &endpoints)?;
            for (i, s) in scores.into_iter().enumerate() {
                totals[i] += spec.weight * s;
                rows[i].push(s);
            }
        }
        let mut keyed = Vec::with_capacity(n);
        for (i, ep) in endpoints.iter().enumerate() {
            keyed.push((
                round9(totals[i]),
                rendezvous(r.tie_key.as_bytes(), ep.url.to_str()?.as_bytes()),
                i,
            ));
        }
        // Highest total first, then the highest rendezvous hash; a stable sort, as Python's.
        keyed.sort_by(|a, b| {
            b.0.partial_cmp(&a.0)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(b.1.cmp(&a.1))
        });
        Ok((keyed.into_iter().map(|k| k.2).collect(), totals, rows))
    }
}

/// `scoring.rendezvous`, for the parity test.
#[pyfunction]
#[pyo3(name = "rendezvous")]
pub fn py_rendezvous(key: &Bound<'_, PyBytes>, url: &str) -> u64 {
    rendezvous(key.as_bytes(), url.as_bytes())
}
