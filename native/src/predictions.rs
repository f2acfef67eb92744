//! router/index.py's predictions: which blocks each endpoint will hold once a request routed there is
//! prefilled, until its engine's events confirm them or the prediction expires. A min-heap of expiry
//! records (one per expiry set, not per block), the live predictions in the order they were made, and
//! the endpoints' block tables they predict into; every call that can end predictions returns how many
//! table entries they removed, for the index's size.
//!
//! Each request made a Python object per prediction and a heap tuple per expiry, popped and compared in
//! Python at every lookup, prediction and re-timing; here those are native, and the
//! [`Prediction`] a decision keeps is the one Python object left.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use hashlink::LinkedHashMap;
use pyo3::prelude::*;
use pyo3::types::PyString;
use rustc_hash::FxHashMap;

use crate::{with_hashes, BlockTable};

/// One `predict` call: the blocks it predicted at an endpoint and when they expire. A block lives while
/// any live prediction of it does (its table counts them); ``dead`` once this one ended.
#[pyclass(module = "kvstrata_native")]
pub struct Prediction {
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    endpoint: Py<PyString>,
    #[pyo3(get)]
    expires: f64,
    #[pyo3(get)]
    dead: bool,
    hashes: Vec<u64>,
}

/// A heap record: (expiry, sequence, prediction id), soonest first.
#[derive(PartialEq)]
struct Record(f64, u64, u64);

impl Eq for Record {}

impl PartialOrd for Record {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Record {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

#[pyclass(module = "kvstrata_native")]
pub struct Predictions {
    max_blocks: usize,
    tables: FxHashMap<String, Py<BlockTable>>,
    live: LinkedHashMap<u64, Py<Prediction>>,
    heap: BinaryHeap<Reverse<Record>>,
    predicted: usize, // hashes in live predictions
    next_id: u64,
    seq: u64,
}

impl Predictions {
    /// Ends ``pred``: its blocks lose a holder; the count of table entries that went.
    fn end(&mut self, py: Python<'_>, pred: &Py<Prediction>) -> usize {
        let mut p = pred.borrow_mut(py);
        p.dead = true;
        self.live.remove(&p.id);
        self.predicted -= p.hashes.len();
        let hashes = std::mem::take(&mut p.hashes);
        let endpoint = p.endpoint.bind(py).to_string();
        match self.tables.get(&endpoint) {
            // Confirmed entries stay; unconfirmed ones go when no other live prediction holds them.
            Some(table) => table.borrow_mut(py).expire_all(&hashes, p.id),
            None => 0,
        }
    }

    fn expire_inner(&mut self, py: Python<'_>, now: f64, mut early: i64) -> usize {
        let mut removed = 0;
        while let Some(Reverse(Record(at, _, id))) = self.heap.peek() {
            if !(*at <= now || early > 0) {
                break;
            }
            let (at, id) = (*at, *id);
            self.heap.pop();
            let Some(pred) = self.live.get(&id).map(|p| p.clone_ref(py)) else {
                continue; // ended already
            };
            if at != pred.borrow(py).expires {
                continue; // stale: the prediction has another record
            }
            early -= pred.borrow(py).hashes.len() as i64;
            removed += self.end(py, &pred);
        }
        removed
    }

    /// A heap record at ``pred``'s expiry. Stale records past twice the live predictions are swept by a
    /// rebuild; live predictions past twice the index's bound in blocks are ended early, soonest to
    /// expire first (their hashes are what a prediction costs in memory).
    fn push(&mut self, py: Python<'_>, expires: f64, id: u64, now: f64) -> usize {
        self.seq += 1;
        self.heap.push(Reverse(Record(expires, self.seq, id)));
        if self.heap.len() > 2 * self.live.len() + 64 {
            let mut records = Vec::with_capacity(self.live.len());
            for (&id, p) in self.live.iter() {
                self.seq += 1;
                records.push(Reverse(Record(p.borrow(py).expires, self.seq, id)));
            }
            self.heap = BinaryHeap::from(records);
        }
        if self.predicted > 2 * self.max_blocks {
            let early = (self.predicted - 2 * self.max_blocks) as i64;
            return self.expire_inner(py, now, early);
        }
        0
    }
}

#[pymethods]
impl Predictions {
    #[new]
    fn new(max_blocks: usize) -> Self {
        Self {
            max_blocks,
            tables: FxHashMap::default(),
            live: LinkedHashMap::new(),
            heap: BinaryHeap::new(),
            predicted: 0,
            next_id: 0,
            seq: 0,
        }
    }

    /// Live predictions.
    fn __len__(&self) -> usize {
        self.live.len()
    }

    /// Heap records, stale ones included (bounded by twice the live predictions and a few).
    #[getter]
    fn records(&self) -> usize {
        self.heap.len()
    }

    /// Hashes in live predictions.
    #[getter]
    fn predicted_hashes(&self) -> usize {
        self.predicted
    }

    /// ``endpoint``'s blocks are ``table`` (from now on, predictions ending there expire in it).
    fn attach(&mut self, endpoint: String, table: Py<BlockTable>) {
        self.tables.insert(endpoint, table);
    }

    /// ``endpoint`` left: predictions of it that end later touch no table.
    fn detach(&mut self, endpoint: &str) {
        self.tables.remove(endpoint);
    }

    /// End the predictions whose expiry is at or before ``now``; the table entries that went.
    fn expire(&mut self, py: Python<'_>, now: f64) -> usize {
        self.expire_inner(py, now, 0)
    }

    /// Predict ``hashes`` at ``endpoint`` (attached) until ``expires``; ``touched`` leading blocks were
    /// just matched there by a lookup. Returns (the prediction, table entries added, entries removed
    /// by predictions ended early to keep the bound).
    fn predict(
        &mut self,
        py: Python<'_>,
        endpoint: Bound<'_, PyString>,
        hashes: &Bound<'_, PyAny>,
        expires: f64,
        touched: usize,
        now: f64,
    ) -> PyResult<(Py<Prediction>, usize, usize)> {
        self.next_id += 1;
        let id = self.next_id;
        let hashes: Vec<u64> = with_hashes(hashes, |h| h.to_vec())?;
        let key = endpoint.to_str()?;
        let added = match self.tables.get(key) {
            Some(table) => table.borrow_mut(py).predict_all(&hashes, id, touched),
            None => {
                return Err(pyo3::exceptions::PyKeyError::new_err(format!(
                    "no table attached for {key}"
                )))
            }
        };
        self.predicted += hashes.len();
        let pred = Py::new(
            py,
            Prediction {
                id,
                endpoint: endpoint.unbind(),
                expires,
                dead: false,
                hashes,
            },
        )?;
        self.live.insert(id, pred.clone_ref(py));
        let removed = self.push(py, expires, id, now);
        Ok((pred, added, removed))
    }

    /// Give ``pred``'s blocks a new expiry (those other live predictions hold too stay while those do),
    /// after ending what expired by ``now``; the table entries that went.
    fn retime(
        &mut self,
        py: Python<'_>,
        pred: &Bound<'_, Prediction>,
        expires: f64,
        now: f64,
    ) -> usize {
        let mut removed = self.expire_inner(py, now, 0);
        let id = {
            let mut p = pred.borrow_mut();
            if p.dead {
                return removed;
            }
            p.expires = expires;
            p.id
        };
        removed += self.push(py, expires, id, now);
        removed
    }
}
