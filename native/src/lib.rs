//! The per-block loops of kvstrata's router, in Rust: a long prompt is thousands of KV blocks (4,096 at
//! 128K tokens, block size 32), and walking them through Python dicts cost milliseconds per request
//! (`make bench-router-overhead`). Policy stays in Python (router/index.py, router/scoring.py); these
//! types only hold per-endpoint maps and do bulk operations on them, each one pass in native code.
//!
//! Hashes come in as the router's ``array('Q')`` chains, read in place through the buffer protocol, or
//! as any sequence of ints (KV events), converted.

use hashlink::LinkedHashMap;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use rustc_hash::{FxBuildHasher, FxHashSet};

// Medium bits, as router/index.py uses them.
const GPU: u8 = 1;
const CPU: u8 = 2;
const STORAGE: u8 = 4;
const PREDICTED: u8 = 8;
const REAL: u8 = GPU | CPU | STORAGE;

type Ordered<V> = LinkedHashMap<u64, V, FxBuildHasher>;

/// Calls ``f`` with the hashes of ``obj``: a contiguous buffer of unsigned 64-bit ints is read in place;
/// any other sequence of ints is converted first (~40 ns per 64-bit Python int, what the buffer avoids).
fn with_hashes<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[u64]) -> R) -> PyResult<R> {
    if let Ok(buf) = PyBuffer::<u64>::get(obj) {
        if buf.is_c_contiguous() {
            // SAFETY: a C-contiguous buffer of item_count u64s, kept alive and unresizable while `buf`
            // is held; nothing in `f` runs Python code.
            let items = unsafe {
                std::slice::from_raw_parts(buf.buf_ptr() as *const u64, buf.item_count())
            };
            return Ok(f(items));
        }
    }
    let items: Vec<u64> = obj.extract()?;
    Ok(f(&items))
}

#[derive(Clone, Copy)]
struct Entry {
    mask: u8,
    pred: u64, // the prediction that set an unconfirmed entry's expiry; 0 = none
}

/// One endpoint's blocks: hash -> (media mask, prediction id), least recently touched first.
#[pyclass(module = "kvstrata_native")]
struct BlockTable {
    map: Ordered<Entry>,
}

impl BlockTable {
    fn prefix_of(&mut self, hashes: &[u64]) -> (usize, usize, usize, usize, usize) {
        let (mut n, mut gpu, mut cpu, mut storage, mut predicted) = (0, 0, 0, 0, 0);
        for h in hashes {
            let Some(e) = self.map.to_back(h) else { break };
            n += 1;
            if e.mask & GPU != 0 {
                gpu += 1;
            } else if e.mask & CPU != 0 {
                cpu += 1;
            } else if e.mask & STORAGE != 0 {
                storage += 1;
            } else {
                predicted += 1;
            }
        }
        (n, gpu, cpu, storage, predicted)
    }

    fn store_all(&mut self, hashes: &[u64], bit: u8) -> usize {
        let mut added = 0;
        for &h in hashes {
            match self.map.to_back(&h) {
                Some(e) => {
                    e.mask = (e.mask | bit) & REAL;
                    e.pred = 0;
                }
                None => {
                    self.map.insert(h, Entry { mask: bit, pred: 0 });
                    added += 1;
                }
            }
        }
        added
    }

    fn remove_all(&mut self, hashes: &[u64], bit: u8) -> (usize, Vec<u64>) {
        let mut matched = 0;
        let mut gone = Vec::new();
        for &h in hashes {
            let Some(e) = self.map.get_mut(&h) else {
                continue;
            };
            if e.mask & bit != 0 {
                matched += 1;
            }
            let mask = e.mask & !bit & REAL;
            if mask != 0 {
                e.mask = mask;
            } else {
                self.map.remove(&h);
                gone.push(h);
            }
        }
        (matched, gone)
    }

    fn predict_all(
        &mut self,
        hashes: &[u64],
        pred: u64,
        repoint: usize,
        touched: usize,
    ) -> (usize, Vec<u64>) {
        // One probe per block: the predictions of the known leading blocks, where the first unknown
        // block is, and whether a block after it is known (a hole).
        let mut head_preds = Vec::with_capacity(hashes.len());
        let mut known = hashes.len();
        let mut holes = false;
        for (i, h) in hashes.iter().enumerate() {
            match self.map.get(h) {
                Some(e) if known == hashes.len() => head_preds.push(e.pred),
                Some(_) => {
                    holes = true;
                    break;
                }
                None if known == hashes.len() => known = i,
                None => {}
            }
        }
        let mut added = 0;
        let mut olds = Vec::new();
        if holes {
            for h in hashes {
                match self.map.to_back(h) {
                    Some(e) => {
                        if e.mask & REAL == 0 {
                            e.pred = pred;
                        }
                    }
                    None => {
                        self.map.insert(
                            *h,
                            Entry {
                                mask: PREDICTED,
                                pred,
                            },
                        );
                        added += 1;
                    }
                }
            }
            return (added, olds);
        }
        if known <= repoint {
            for h in &hashes[..known] {
                if let Some(e) = self.map.get_mut(h) {
                    if e.mask == PREDICTED {
                        e.pred = pred;
                    }
                }
            }
        } else {
            let mut seen = FxHashSet::default();
            for p in head_preds {
                if p != 0 && seen.insert(p) {
                    olds.push(p);
                }
            }
        }
        for h in hashes.iter().take(known).skip(touched) {
            self.map.to_back(h);
        }
        for h in &hashes[known..] {
            if self
                .map
                .insert(
                    *h,
                    Entry {
                        mask: PREDICTED,
                        pred,
                    },
                )
                .is_none()
            {
                added += 1;
            }
        }
        (added, olds)
    }

    fn expire_all(&mut self, hashes: &[u64], pred: u64) -> usize {
        let mut n = 0;
        for h in hashes {
            if matches!(self.map.get(h), Some(e) if e.mask == PREDICTED && e.pred == pred) {
                self.map.remove(h);
                n += 1;
            }
        }
        n
    }
}

#[pymethods]
impl BlockTable {
    #[new]
    fn new() -> Self {
        Self {
            map: Ordered::with_hasher(FxBuildHasher),
        }
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    fn __contains__(&self, h: u64) -> bool {
        self.map.contains_key(&h)
    }

    /// The block's media mask, 0 if the table does not hold it.
    fn mask(&self, h: u64) -> u8 {
        self.map.get(&h).map_or(0, |e| e.mask)
    }

    /// The leading blocks of ``hashes`` held here, as (blocks, gpu, cpu, storage, predicted) counted by
    /// each block's best medium; the matched blocks become the most recently touched, in order.
    fn prefix(
        &mut self,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, usize, usize, usize)> {
        with_hashes(hashes, |h| self.prefix_of(h))
    }

    /// A BlockStored on medium ``bit``: new blocks are added, known ones gain the medium and lose
    /// their prediction (confirmed). Returns how many were added.
    fn store(&mut self, hashes: &Bound<'_, PyAny>, bit: u8) -> PyResult<usize> {
        with_hashes(hashes, |h| self.store_all(h, bit))
    }

    /// A BlockRemoved on medium ``bit``: (how many of the blocks were held on that medium, the blocks
    /// now gone from every medium, which the table no longer holds).
    fn remove(&mut self, hashes: &Bound<'_, PyAny>, bit: u8) -> PyResult<(usize, Vec<u64>)> {
        with_hashes(hashes, |h| self.remove_all(h, bit))
    }

    /// Record that the endpoint will hold ``hashes`` under prediction ``pred``; ``touched`` leading
    /// blocks were just touched by a lookup. Returns (blocks added, the distinct earlier predictions of
    /// the known leading blocks when there are more than ``repoint`` of them). Known blocks then new
    /// ones (a prompt seen before, maybe extended): up to ``repoint`` known unconfirmed blocks move to
    /// ``pred``; past that they keep theirs, and the caller makes ``pred`` hold those predictions. Any
    /// other shape: every unconfirmed known block moves to ``pred``.
    fn predict(
        &mut self,
        hashes: &Bound<'_, PyAny>,
        pred: u64,
        repoint: usize,
        touched: usize,
    ) -> PyResult<(usize, Vec<u64>)> {
        with_hashes(hashes, |h| self.predict_all(h, pred, repoint, touched))
    }

    /// Prediction ``pred`` expired: remove the blocks it still holds (unconfirmed, not predicted
    /// again since). Returns how many.
    fn expire(&mut self, hashes: &Bound<'_, PyAny>, pred: u64) -> PyResult<usize> {
        with_hashes(hashes, |h| self.expire_all(h, pred))
    }

    /// Remove and return the least recently touched block: (hash, mask).
    fn pop_oldest(&mut self) -> Option<(u64, u8)> {
        self.map.pop_front().map(|(h, e)| (h, e.mask))
    }

    fn clear(&mut self) {
        self.map.clear();
    }

    /// (hash, prediction id) of every unconfirmed block.
    fn predicted(&self) -> Vec<(u64, u64)> {
        self.map
            .iter()
            .filter(|(_, e)| e.mask == PREDICTED && e.pred != 0)
            .map(|(h, e)| (*h, e.pred))
            .collect()
    }
}

/// Block hash -> when it was last touched (a float clock), oldest first: an endpoint's recent demand.
#[pyclass(module = "kvstrata_native")]
struct Recency {
    map: Ordered<f64>,
}

#[pymethods]
impl Recency {
    #[new]
    fn new() -> Self {
        Self {
            map: Ordered::with_hasher(FxBuildHasher),
        }
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    /// Every hash of ``hashes`` was touched at ``now``: it becomes the newest.
    fn touch(&mut self, hashes: &Bound<'_, PyAny>, now: f64) -> PyResult<()> {
        with_hashes(hashes, |hashes| {
            for &h in hashes {
                match self.map.to_back(&h) {
                    Some(t) => *t = now,
                    None => {
                        self.map.insert(h, now);
                    }
                }
            }
        })
    }

    /// Drop the hashes touched before ``horizon`` (touched in time order); the count left.
    fn expire_before(&mut self, horizon: f64) -> usize {
        while matches!(self.map.front(), Some((_, t)) if *t < horizon) {
            self.map.pop_front();
        }
        self.map.len()
    }

    /// Drop the oldest hashes past ``limit``.
    fn trim(&mut self, limit: usize) {
        while self.map.len() > limit {
            self.map.pop_front();
        }
    }
}

#[pymodule]
fn kvstrata_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GPU", GPU)?;
    m.add("CPU", CPU)?;
    m.add("STORAGE", STORAGE)?;
    m.add("PREDICTED", PREDICTED)?;
    m.add_class::<BlockTable>()?;
    m.add_class::<Recency>()?;
    Ok(())
}
